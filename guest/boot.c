/*
 * PID 1 boot: the kernel filesystems and fds 0-2, the kernel command line, the virtio modules,
 * the bounded wait for the root disk and the agent port, the switch into the image's root, the
 * hostname and loopback. Only as PID 1 in a VM: host test mode has no boot duties.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Boot waits for the root disk and the agent port at most this long: virtio devices appear
 * asynchronously after their modules load (probe + devtmpfs node creation), which takes
 * well under a second even under TCG. The bound keeps a misconfigured VM (no disk) from
 * hanging in boot: the agent comes up anyway and reports the problem as LOG frames. */
#define BOOT_WAIT_MS 10000
#define BOOT_POLL_MS 10
#define SBX_MODULE_INIT_COMPRESSED_FILE 4
#define SBX_RAMFS_MAGIC 0x858458f6u
#define SBX_TMPFS_MAGIC 0x01021994u

static void mount_logged(const char *src, const char *dst, const char *type, unsigned long flags, const char *data) {
  mkdir(dst, 0755);
  if (mount(src, dst, type, flags, data) < 0 && errno != EBUSY)
    logmsg("mount %s on %s: %s", type ? type : src, dst, strerror(errno));
}

/* The kernel hands init fds 0-2 on /dev/console only when the initramfs has that node; make sure
 * 0-2 are occupied so no pipe ever lands there (dup2 in the child would then clobber it). */
void ensure_std_fds(void) {
  for (int fd = 0; fd < 3; fd++) {
    if (fcntl(fd, F_GETFD) >= 0) continue;
    int n = open("/dev/null", O_RDWR);
    if (n < 0) n = open("/", O_RDONLY);
    if (n >= 0 && n != fd) {
      dup2(n, fd);
      close(n);
    }
  }
}

static char cmd_hostname[65];
static char cmd_root[128] = "/dev/vda";

static void parse_cmdline(void) {
  char buf[4096];
  int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return;
  buf[n] = 0;
  for (char *save = NULL, *tok = strtok_r(buf, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
    if (strncmp(tok, "sandboxd.hostname=", 18) == 0) snprintf(cmd_hostname, sizeof cmd_hostname, "%s", tok + 18);
    /* sandboxd.root=none keeps the initramfs as root (diagnostics, tests of the initramfs). */
    if (strncmp(tok, "sandboxd.root=", 14) == 0) snprintf(cmd_root, sizeof cmd_root, "%s", tok + 14);
  }
}

static int ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* /etc/modules.order: one module per line, in dependency order (the initramfs builder writes
 * it). A line is an absolute path, a path relative to /lib/modules, or a bare file name. */
static void load_modules(void) {
  FILE *f = fopen("/etc/modules.order", "re");
  if (!f) {
    logmsg("no /etc/modules.order: no modules loaded");
    return;
  }
  char line[512];
  int loaded = 0;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\r\n")] = 0;
    char *s = line;
    while (*s == ' ' || *s == '\t') s++;
    if (!*s || *s == '#') continue;
    const char *base = strrchr(s, '/') ? strrchr(s, '/') + 1 : s;
    char cand[3][600];
    snprintf(cand[0], sizeof cand[0], "%s%s", s[0] == '/' ? "" : "/lib/modules/", s);
    snprintf(cand[1], sizeof cand[1], "/lib/modules/%s", base);
    snprintf(cand[2], sizeof cand[2], "/%s", s);
    int fd = -1;
    for (int i = 0; i < 3 && fd < 0; i++) fd = open(cand[i], O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      logmsg("module %s: not found", s);
      continue;
    }
    int flags = ends_with(s, ".xz") || ends_with(s, ".zst") || ends_with(s, ".gz") ? SBX_MODULE_INIT_COMPRESSED_FILE : 0;
    if (syscall(SYS_finit_module, fd, "", flags) < 0 && errno != EEXIST)
      logmsg("module %s: finit_module: %s", s, strerror(errno));
    else
      loaded++;
    close(fd);
  }
  fclose(f);
  logmsg("%d modules loaded", loaded);
}

/* Recursively delete the initramfs (its pages are RAM that nothing needs after the switch),
 * staying on its own filesystem: /newroot and anything mounted is skipped by st_dev. */
static void rm_tree(int dfd, dev_t dev) {
  DIR *d = fdopendir(dfd);
  if (!d) {
    close(dfd);
    return;
  }
  struct dirent *de;
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    struct stat st;
    if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || st.st_dev != dev) continue;
    if (S_ISDIR(st.st_mode)) {
      int sub = openat(dfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) rm_tree(sub, dev);
      unlinkat(dfd, de->d_name, AT_REMOVEDIR);
    } else {
      unlinkat(dfd, de->d_name, 0);
    }
  }
  closedir(d);
}

static int has_virtio_block(void) {
  /* A virtio device of type 2 (block) declared on the bus: then a /dev/vda will come. */
  DIR *d = opendir("/sys/bus/virtio/devices");
  if (!d) return 0;
  struct dirent *de;
  int found = 0;
  while (!found && (de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    char p[512], v[32] = "";
    snprintf(p, sizeof p, "/sys/bus/virtio/devices/%s/device", de->d_name);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t r = read(fd, v, sizeof v - 1);
    close(fd);
    if (r > 0 && strtoul(v, NULL, 0) == 2) found = 1;
  }
  closedir(d);
  return found;
}

/* Mount the image disk and make it / the way a container runtime would. */
static void switch_root(void) {
  if (strcmp(cmd_root, "none") == 0) return;
  mkdir("/newroot", 0755);
  if (mount(cmd_root, "/newroot", "ext4", 0, NULL) < 0) {
    logmsg("mount %s on /newroot: %s; staying in the initramfs", cmd_root, strerror(errno));
    return;
  }
  /* Move the kernel filesystems into the new root (the image has empty dirs for them; made if
   * missing). The image's /tmp and /run stay as they are on its disk, as in a container image. */
  static const char *const moves[] = {"/dev", "/proc", "/sys"};
  for (size_t i = 0; i < 3; i++) {
    char dst[64];
    snprintf(dst, sizeof dst, "/newroot%s", moves[i]);
    mkdir(dst, 0755);
    if (mount(moves[i], dst, NULL, MS_MOVE, NULL) < 0) logmsg("move %s: %s", moves[i], strerror(errno));
  }
  mount_logged("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
  mount_logged("shm", "/newroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
  /* devtmpfs lacks the /proc/self/fd links a runtime adds (bash process substitution needs them). */
  static const char *const links[][2] = {
      {"/proc/self/fd", "/newroot/dev/fd"},
      {"/proc/self/fd/0", "/newroot/dev/stdin"},
      {"/proc/self/fd/1", "/newroot/dev/stdout"},
      {"/proc/self/fd/2", "/newroot/dev/stderr"},
  };
  for (size_t i = 0; i < 4; i++) {
    if (symlink(links[i][0], links[i][1]) < 0 && errno != EEXIST) logmsg("symlink %s: %s", links[i][1], strerror(errno));
  }
  if (chdir("/newroot") < 0) {
    logmsg("chdir /newroot: %s", strerror(errno));
    return;
  }
  struct statfs sf;
  if (statfs("/", &sf) == 0 && ((uint32_t)sf.f_type == SBX_RAMFS_MAGIC || (uint32_t)sf.f_type == SBX_TMPFS_MAGIC)) {
    struct stat st;
    int rfd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rfd >= 0 && fstat(rfd, &st) == 0)
      rm_tree(rfd, st.st_dev);
    else if (rfd >= 0)
      close(rfd);
  }
  /* switch_root: the new root replaces / in our mount namespace; chroot so that "/" of every
   * process we fork is the image. */
  if (mount(".", "/", NULL, MS_MOVE, NULL) < 0) {
    logmsg("move /newroot to /: %s", strerror(errno));
    return;
  }
  if (chroot(".") < 0) logmsg("chroot: %s", strerror(errno));
  if (chdir("/") < 0) logmsg("chdir /: %s", strerror(errno));
  logmsg("switched root to %s", cmd_root);
}

static void loopback_up(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return;
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  /* Bringing lo up makes the kernel add 127.0.0.1/8 and ::1 itself. */
  if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0 || (ifr.ifr_flags |= IFF_UP | IFF_RUNNING, ioctl(s, SIOCSIFFLAGS, &ifr) < 0))
    logmsg("lo up: %s", strerror(errno));
  close(s);
}

/* First thing as PID 1, before any fd is opened: the kernel filesystems and fds 0-2. */
void early_boot(void) {
  mount_logged("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
  ensure_std_fds();
  console_fd = open("/dev/console", O_WRONLY | O_NOCTTY | O_CLOEXEC);
  mount_logged("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
  mount_logged("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

void boot(void) {
  parse_cmdline();
  load_modules();
  /* Wait (bounded, BOOT_WAIT_MS) for the root disk and the agent port; both appear
   * asynchronously once their modules probe. */
  int64_t until = mono_ms() + BOOT_WAIT_MS;
  int want_root = strcmp(cmd_root, "none") != 0;
  for (;;) {
    struct stat st;
    int root_ok = !want_root || stat(cmd_root, &st) == 0;
    if (port_fd < 0) open_agent_port(1);
    if (root_ok && port_fd >= 0) break;
    /* No virtio block device declared at all: do not wait for one that will never come. */
    if (!root_ok && !has_virtio_block() && mono_ms() > until - BOOT_WAIT_MS + 500) want_root = 0;
    if (mono_ms() >= until) {
      if (!root_ok) logmsg("%s did not appear within %d ms", cmd_root, BOOT_WAIT_MS);
      if (port_fd < 0) logmsg("agent port did not appear within %d ms; still looking", BOOT_WAIT_MS);
      break;
    }
    usleep(BOOT_POLL_MS * 1000);
  }
  switch_root();
  if (cmd_hostname[0] && sethostname(cmd_hostname, strlen(cmd_hostname)) < 0)
    logmsg("sethostname %s: %s", cmd_hostname, strerror(errno));
  loopback_up();
  boot_id_bind();
  struct timespec ts;
  clock_gettime(CLOCK_BOOTTIME, &ts);
  logmsg("ready %ld ms after kernel start", (long)(ts.tv_sec * 1000 + ts.tv_nsec / 1000000));
}
