/* Copyright mstar-kv authors.
 * A library that looks like Mooncake's transfer engine but stops half way:
 * it exports the first few C API names and lacks "openSegment", so the
 * loader must name that symbol. Never called. */
#include <stddef.h>
#include <stdint.h>

void* createTransferEngine(const char* a, const char* b, const char* c, uint64_t port,
                           int discover) {
  (void)a;
  (void)b;
  (void)c;
  (void)port;
  (void)discover;
  return NULL;
}
int getLocalIpAndPort(void* e, char* buf, size_t len) {
  (void)e;
  (void)buf;
  (void)len;
  return -1;
}
void* installTransport(void* e, const char* proto, void** args) {
  (void)e;
  (void)proto;
  (void)args;
  return NULL;
}
