"""The main job: its one owner (`run.run_main`), its plan and decision, its build, and the
local build."""
