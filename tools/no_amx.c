/* Deny a whole process AMX, so that an AMX Xeon runs every library's non-AMX code (as a
 * Zen 4 would): Linux grants the AMX tile state only to a process that asks for it
 * (arch_prctl ARCH_REQ_XCOMP_PERM), and this makes that request fail for everyone in the
 * process: kvserve's kernels, oneDNN and torch's own (SDPA's brgemm ignores
 * ONEDNN_MAX_CPU_ISA and used AMX under it).
 *
 *   gcc -O2 -shared -fPIC tools/no_amx.c -o /tmp/no_amx.so -ldl
 *   LD_PRELOAD=/tmp/no_amx.so kvserve bench ...
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023

long syscall(long number, ...) {
  va_list ap;
  va_start(ap, number);
  long a[6];
  for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
  va_end(ap);
  if (number == SYS_arch_prctl && a[0] == ARCH_REQ_XCOMP_PERM) {
    errno = EPERM;
    return -1;
  }
  static long (*real)(long, ...);
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
