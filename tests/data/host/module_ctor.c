/* The same module with a constructor that runs at load and one more export: what a
   hostile prebuilt file would add. */
void* PyInit_module(void) { return 0; }
int helper(int x) { return x + 1; }
__attribute__((constructor)) static void run_at_import(void) {}
int extra_entry(void) { return 7; }
