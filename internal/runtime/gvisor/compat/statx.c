/*
 * statx-compat: an LD_PRELOAD shim for gVisor releases (Debian bookworm's runsc
 * 20221219) whose statx(2) rejects the AT_NO_AUTOMOUNT flag with EINVAL. GNU coreutils
 * 9 (ls, stat, cp, ...) always passes it, so without this shim `ls` fails with
 * "Invalid argument" inside sandboxes. AT_NO_AUTOMOUNT only matters for automount
 * points, which gVisor does not have, so dropping it changes nothing else.
 *
 * Build: see gen.sh (go generate ./internal/runtime/gvisor/...).
 */
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
	return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
