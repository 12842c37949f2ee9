/* LD_PRELOAD shim: makes wildcard binds (0.0.0.0 / [::]) bind to $KPARALLAX_BIND_ADDRESS instead.
 *
 * TensorFlow 2.15's gRPC server hard-codes its listening address as "0.0.0.0:PORT", which would expose an
 * unauthenticated PS on every interface. kparallax-run preloads this into PS and worker tasks with
 * KPARALLAX_BIND_ADDRESS set to the task's cluster address (an IPv4 address). Non-wildcard binds are untouched.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real_bind = NULL;
  if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *wanted = getenv("KPARALLAX_BIND_ADDRESS");
  struct in_addr v4;
  if (wanted == NULL || addr == NULL || inet_pton(AF_INET, wanted, &v4) != 1) return real_bind(fd, addr, len);
  if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof a);
    if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
      a.sin_addr = v4;
      return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
  } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof a);
    if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
      memset(&a.sin6_addr, 0, sizeof a.sin6_addr); /* IPv4-mapped ::ffff:a.b.c.d on a dual-stack socket */
      a.sin6_addr.s6_addr[10] = 0xff;
      a.sin6_addr.s6_addr[11] = 0xff;
      memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
      return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
  }
  return real_bind(fd, addr, len);
}
