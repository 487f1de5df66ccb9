// Host code that needs torch the four ways a real extension does: a function, a vtable, a
// typeinfo (each C++, in torch's namespaces) and a call into torch's stable C shim.
extern "C" int aoti_torch_get_device_index(void*, int*);
extern void log_here(const char*, int, int, bool) __asm__("_ZN3c1013MessageLoggerC1EPKciib");
extern char vtable[] __asm__("_ZTVN3c1011StorageImplE");
extern char typeinfo[] __asm__("_ZTIN2at6TensorE");
extern "C" void* uses_torch(int* out) {
  log_here("x", 1, 2, true);
  aoti_torch_get_device_index(nullptr, out);
  return *out ? static_cast<void*>(vtable) : static_cast<void*>(typeinfo);
}
