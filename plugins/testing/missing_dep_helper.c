/* The helper library libkvb_transport_missing_dep.so links against. It is built into a
 * directory that neither the loader nor the dynamic linker searches, so dlopen of the plugin
 * fails on this dependency and the loader must report the plugin unavailable. */
__attribute__((visibility("default"))) int kvbtest_helper_value(void) { return 42; }
