from sm121_build.cli import main

main()
