/*
 * The machine-wide state the host sets: the entropy pool (ENTROPY, and an exec's SEED), the
 * realtime clock (SET_CLOCK), the hostname and the boot id (SET_HOSTNAME). After a snapshot
 * restore these are what make each VM its own machine. Host test mode leaves the host's alone.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* linux/random.h is not in musl's headers; the ioctl numbers are ABI. */
#define SBX_RNDADDENTROPY 0x40085203u /* _IOW('R', 0x03, int[2]) */
#define SBX_RNDRESEEDCRNG 0x5207u     /* _IO('R', 0x07), Linux >= 4.17 */

/* RNDADDENTROPY counts the bytes as entropy (the host draws them from its CRNG), then
 * RNDRESEEDCRNG makes the CRNG use them now: after a snapshot restore every fork must diverge
 * at once (the guest kernel has no vmgenid to reseed it on restore). Host mode only writes the
 * bytes to /dev/urandom (uncredited, harmless): tests must not play with the host's pool. */
int mix_entropy(const uint8_t *d, size_t n) {
  if (n > SBX_MAX_PAYLOAD) n = SBX_MAX_PAYLOAD;
  int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = 0;
  if (host_mode) {
    if (n && write(fd, d, n) < 0) rc = -1;
  } else {
    struct {
      int entropy_count;
      int buf_size;
    } *info = malloc(sizeof *info + n);
    if (!info) {
      close(fd);
      return -1;
    }
    info->entropy_count = (int)(n * 8);
    info->buf_size = (int)n;
    memcpy(info + 1, d, n);
    if (ioctl(fd, SBX_RNDADDENTROPY, info) < 0) rc = -1;
    free(info);
    if (rc == 0 && ioctl(fd, SBX_RNDRESEEDCRNG) < 0) rc = -1;
  }
  int saved = errno;
  close(fd);
  errno = saved;
  return rc;
}

/*
 * The kernel fixes /proc/sys/kernel/random/boot_id at boot, so every VM restored from one
 * snapshot would report its template's id and programs keying state on it (systemd-style
 * tooling, caches) would take forks for one machine. Each restored VM gets its own: the host
 * sends a fresh UUID, which we write to a file on /dev (devtmpfs: memory only, not part of the
 * image) and bind-mount over the procfs file (procfs entries accept bind mounts).
 *
 * The mount is made once, at boot (boot_id_bind: the file then holds the kernel's own id), so a
 * restored VM only rewrites the file's 37 bytes in place: a mount and the umount of the previous
 * one cost ~10-15 ms in a freshly restored VM under TCG (the first of its identity steps), a
 * write well under 1 ms. A VM whose boot did not make the mount (a template frozen by an older
 * agent) gets it here, once; a second call then finds it and writes in place.
 */
static const char BOOT_ID_TARGET[] = "/proc/sys/kernel/random/boot_id";
static const char BOOT_ID_FILE[] = "/dev/.sandboxd-boot_id";
#define BOOT_ID_LINE 37 /* 36 characters of a UUID and a newline */

/* Writes `line` into the bind-mounted file in place; -1 (errno ENOENT) when the mount is not there. */
static int rewrite_boot_id(const char *line) {
  int fd = open(BOOT_ID_FILE, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat file, target;
  int bound = fstat(fd, &file) == 0 && stat(BOOT_ID_TARGET, &target) == 0 && file.st_dev == target.st_dev &&
              file.st_ino == target.st_ino;
  /* Same length every time: one positioned write replaces the whole id, with no empty moment. */
  ssize_t w = bound ? pwrite(fd, line, BOOT_ID_LINE, 0) : -1;
  close(fd);
  if (!bound) {
    errno = ENOENT;
    return -1;
  }
  return w == BOOT_ID_LINE ? 0 : -1;
}

/* Creates the file from `line` (atomically) and bind-mounts it over the procfs entry. */
static int bind_boot_id(const char *line) {
  char tmp[64];
  snprintf(tmp, sizeof tmp, "%s.tmp", BOOT_ID_FILE);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
  if (fd < 0) return -1;
  ssize_t w = write(fd, line, BOOT_ID_LINE);
  close(fd);
  if (w != BOOT_ID_LINE || rename(tmp, BOOT_ID_FILE) < 0) return -1;
  umount2(BOOT_ID_TARGET, MNT_DETACH); /* EINVAL when nothing is mounted there yet: fine */
  return mount(BOOT_ID_FILE, BOOT_ID_TARGET, NULL, MS_BIND, NULL);
}

void boot_id_bind(void) {
  char line[BOOT_ID_LINE + 1] = "";
  int fd = open(BOOT_ID_TARGET, O_RDONLY | O_CLOEXEC);
  ssize_t r = fd < 0 ? -1 : read(fd, line, BOOT_ID_LINE);
  if (fd >= 0) close(fd);
  if (r != BOOT_ID_LINE || line[BOOT_ID_LINE - 1] != '\n' || bind_boot_id(line) < 0)
    logmsg("boot id: cannot bind %s over %s: %s", BOOT_ID_FILE, BOOT_ID_TARGET, strerror(errno));
}

static int set_boot_id(const uint8_t *v, size_t len) {
  if (len != 36) {
    errno = EINVAL;
    return -1;
  }
  for (size_t i = 0; i < len; i++) {
    int dash = i == 8 || i == 13 || i == 18 || i == 23;
    char c = (char)v[i];
    if (dash ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
      errno = EINVAL;
      return -1;
    }
  }
  char line[BOOT_ID_LINE];
  memcpy(line, v, 36);
  line[36] = '\n';
  if (rewrite_boot_id(line) == 0) return 0;
  return errno == ENOENT ? bind_boot_id(line) : -1;
}

void op_entropy(uint32_t stream, const uint8_t *p, size_t n) {
  struct tlv t = {0};
  tlv_find(p, n, SBX_TAG_DATA, &t);
  if (mix_entropy(t.v, t.len) < 0)
    respond_errno(stream, errno, "entropy", NULL);
  else
    respond_status(stream, 0, NULL);
}

void op_set_clock(uint32_t stream, const uint8_t *p, size_t n) {
  uint64_t ns = 0;
  if (tlv_get_u64(p, n, SBX_TAG_REALTIME_NS, &ns) != 1) {
    respond_status(stream, EINVAL, "set_clock: REALTIME_NS missing");
    return;
  }
  if (host_mode) { /* never set the host's clock from a test */
    respond_status(stream, 0, NULL);
    return;
  }
  struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
  if (clock_settime(CLOCK_REALTIME, &ts) < 0)
    respond_errno(stream, errno, "set_clock", NULL);
  else
    respond_status(stream, 0, NULL);
}

void op_set_hostname(uint32_t stream, const uint8_t *p, size_t n) {
  struct tlv t;
  if (!tlv_find(p, n, SBX_TAG_HOSTNAME, &t)) {
    respond_status(stream, EINVAL, "set_hostname: HOSTNAME missing");
    return;
  }
  if (host_mode) { /* never rename the host from a test */
    respond_status(stream, t.len > 64 ? EINVAL : 0, t.len > 64 ? "set_hostname: too long" : NULL);
    return;
  }
  if (sethostname((const char *)t.v, t.len) < 0) {
    respond_errno(stream, errno, "set_hostname", NULL);
    return;
  }
  struct tlv bid;
  if (tlv_find(p, n, SBX_TAG_BOOT_ID, &bid) && set_boot_id(bid.v, bid.len) < 0) {
    respond_errno(stream, errno, "set_hostname: boot id", NULL);
    return;
  }
  respond_status(stream, 0, NULL);
}
