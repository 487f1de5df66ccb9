/* A Python-extension-shaped shared object: its PyInit_ export and one function. */
void* PyInit_module(void) { return 0; }
int helper(int x) { return x + 1; }
