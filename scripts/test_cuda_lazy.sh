#!/usr/bin/env bash
# scripts/test_cuda_lazy.sh: checks scripts/cuda_lazy.py (the lazy CUDA
# loader) on any x86-64 Linux machine, with a stand-in library: a program
# linked against the generated static library must (1) not name the
# library among its DT_NEEDED entries, (2) start and get the stated error
# code, a message string from pointer functions and one stderr line when
# the library is missing, and (3) with the library present, pass every
# argument through unchanged (six integer registers, eight vector
# registers, arguments on the stack, float and pointer returns, a variadic
# call), from several threads racing to the first call.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
cd "$t"

cat >fake.c <<'C'
#include <stdarg.h>
int fake_init(int flags) { return 1000 + flags; }
long fake_ints(long a, long b, long c, long d, long e, long f, long g, long h) {
  return a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g + 8 * h;
}
double fake_floats(int k, float a, double b, float c, double d, float e,
                   double f, float g, double h, double i) {
  return k * (a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g + 8 * h + 9 * i);
}
const char *fake_name(int k) { return k ? "fake-one" : "fake-zero"; }
int fake_sum(int n, ...) {
  va_list ap; va_start(ap, n); double s = 0;
  for (int i = 0; i < n; i++) s += va_arg(ap, double);
  va_end(ap); return (int)s;
}
C
gcc -shared -fPIC -O2 -Wl,-soname,libfake.so.1 -o libfake.so.1 fake.c
printf 'fake_init\nfake_ints\nfake_floats\nfake_name ptr\nfake_sum\n' >names.txt
python3 "$here/cuda_lazy.py" libfake.so.1 34 lazy.c names.txt
gcc -c -fPIC -O2 -o lazy.o lazy.c
mkdir lazy && ar rcs lazy/libfake.a lazy.o

cat >main.c <<'C'
#include <pthread.h>
#include <stdio.h>
#include <string.h>
int fake_init(int);
long fake_ints(long, long, long, long, long, long, long, long);
double fake_floats(int, float, double, float, double, float, double, float, double, double);
const char *fake_name(int);
int fake_sum(int, ...);
static void *race(void *p) { *(long *)p = fake_ints(1, 2, 3, 4, 5, 6, 7, 8); return 0; }
int main(int argc, char **argv) {
  if (!strcmp(argv[1], "missing")) {
    int a = fake_init(5), b = fake_init(6);
    const char *n = fake_name(1);
    printf("%d %d %s\n", a, b, n);
    return !(a == 34 && b == 34 && strstr(n, "libfake.so.1 could not be loaded"));
  }
  pthread_t th[8]; long r[8];
  for (int i = 0; i < 8; i++) pthread_create(&th[i], 0, race, &r[i]);
  for (int i = 0; i < 8; i++) pthread_join(th[i], 0);
  int ok = 1;
  for (int i = 0; i < 8; i++) ok &= r[i] == 204;
  double f = fake_floats(2, 1, 2, 3, 4, 5, 6, 7, 8, 9);
  ok &= fake_init(5) == 1005 && f == 2 * 285.0;
  ok &= !strcmp(fake_name(1), "fake-one") && !strcmp(fake_name(0), "fake-zero");
  ok &= fake_sum(3, 1.5, 2.5, 3.0) == 7;
  printf("%ld %g %s %d -> %s\n", r[0], f, fake_name(1), fake_sum(3, 1.5, 2.5, 3.0), ok ? "ok" : "WRONG");
  return !ok;
}
C
gcc -O2 -o main main.c -Llazy -lfake -ldl -lpthread

fail=0
if readelf -d main | grep -q 'libfake'; then
    echo "FAIL: the program names libfake among its libraries"; fail=1
fi
if ./main missing 2>err.txt; then echo "missing library: $(cat err.txt)"; else
    echo "FAIL: missing library: $(cat err.txt)"; fail=1
fi
if [ "$(grep -c 'phalanx: libfake.so.1' err.txt)" != 1 ]; then
    echo "FAIL: expected one stderr line naming libfake.so.1"; fail=1
fi
if LD_LIBRARY_PATH=$PWD ./main present; then :; else echo "FAIL: present library"; fail=1; fi
[ $fail = 0 ] && echo "cuda_lazy: all checks passed"
exit $fail
