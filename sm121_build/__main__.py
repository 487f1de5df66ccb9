from sm121_build.entry import main

main()
