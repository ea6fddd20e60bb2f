/*
 * PTY tunnels (OP PTY): an interactive shell on a new pseudo-terminal. The shell runs in its own
 * session with the PTY as its controlling terminal; the PTY master becomes the fd of an ordinary
 * tunnel (tunnel.c), so its bytes move as DATA with the same per-direction credit, and what PID 1
 * holds for it is bounded by one window each way like any tunnel. RESIZE sets the window size
 * (the kernel then sends SIGWINCH to the foreground job).
 *
 * Ending: when the tunnel ends (the host's CLOSE, a host hang-up or HELLO, the shell's exit seen
 * by the reaper or as EIO on the master) the master is closed, which hangs up the terminal (SIGHUP to the
 * session), and the shell's process group gets SIGHUP and SIGCONT. PTY_KILL_GRACE_MS later every
 * process still in the shell's session (found in /proc) gets SIGKILL: job-control shells put each
 * job in its own process group, so the group alone would miss `sleep 100 &`. A process that left
 * the session (setsid, a daemon) is outside what the terminal owns and survives, as it would
 * after an ssh logout.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pty.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

/* Between the hang-up (SIGHUP) and SIGKILL: long enough for a shell to save its history and for
 * editors to clean up, short enough that a closed terminal's processes are gone by the time a
 * client looks again. */
#define PTY_KILL_GRACE_MS 1000
/* Sessions waiting for their SIGKILL. Each ended PTY tunnel adds one for PTY_KILL_GRACE_MS; past
 * this many (a host opening and closing terminals in a tight loop) SIGKILL is sent at once. */
#define PTY_PENDING_MAX MAX_TUNNELS
/* Window sizes are u16 in struct winsize; 0 would make full-screen programs divide by zero. */
#define PTY_DIM_MAX 65535
/* Environment entries a PTY request may carry, plus the few we add: the same order of size as
 * an image's ENV, bounded so a request cannot make PID 1 allocate without limit (it is also
 * bounded by the frame size). */
#define PTY_ENV_MAX 4096

static struct {
  pid_t sid;
  int64_t at_ms;
} pending[PTY_PENDING_MAX];
static int n_pending;

/* SIGKILL to every process whose session id is `sid` (the shell's pid: it called setsid). */
static void kill_session(pid_t sid) {
  kill(-sid, SIGKILL); /* the shell's own group, even if /proc cannot be read */
  DIR *d = opendir("/proc");
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d))) { /* bounded by the number of processes in the guest */
    char *end;
    long pid = strtol(de->d_name, &end, 10);
    if (*end || pid <= 1) continue;
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t n = read(fd, line, sizeof line - 1);
    close(fd);
    if (n <= 0) continue;
    line[n] = 0;
    /* pid (comm) state ppid pgrp session: comm may hold spaces and parens, so parse after the
     * last ')'. */
    char *p = strrchr(line, ')');
    int ppid, pgrp, session;
    char state;
    if (!p || sscanf(p + 1, " %c %d %d %d", &state, &ppid, &pgrp, &session) != 4) continue;
    if (session == sid) kill((pid_t)pid, SIGKILL);
  }
  closedir(d);
}

/* The tunnel is ending: hang up its shell now, kill what is left of its session later. */
void pty_hangup(struct tunnel *t) {
  pid_t sid = t->pty_pid;
  if (sid <= 0) return;
  t->pty_pid = 0;
  kill(-sid, SIGHUP);
  kill(-sid, SIGCONT); /* a stopped job must run to see its SIGHUP */
  if (n_pending >= PTY_PENDING_MAX) {
    kill_session(sid);
    return;
  }
  pending[n_pending].sid = sid;
  pending[n_pending].at_ms = mono_ms() + PTY_KILL_GRACE_MS;
  n_pending++;
}

/* The reaper saw `pid` exit: when it is a terminal's shell, the terminal ends now, after what the
 * shell wrote last (as far as the host's credit allows), even if a background job still holds the
 * terminal open: the shell is what the client talks to, and its leftovers go with the session. */
void pty_exited(pid_t pid) {
  for (struct tunnel *t = tunnels; t; t = t->next) {
    if (t->dead || t->pty_pid != pid) continue;
    if (t->send_credit > 0 && !t->host_closed) tunnel_read(t);
    if (!t->dead) tunnel_end(t, 1, 0, NULL);
    return;
  }
}

void pty_timers(int64_t now) {
  for (int i = 0; i < n_pending;) {
    if (now < pending[i].at_ms) {
      i++;
      continue;
    }
    kill_session(pending[i].sid);
    pending[i] = pending[--n_pending];
  }
}

int64_t pty_next_deadline(void) {
  int64_t next = INT64_MAX;
  for (int i = 0; i < n_pending; i++)
    if (pending[i].at_ms < next) next = pending[i].at_ms;
  return next;
}

static void set_winsize(int fd, uint32_t cols, uint32_t rows) {
  struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
  if (ioctl(fd, TIOCSWINSZ, &ws) < 0) logmsg("pty: TIOCSWINSZ: %s", strerror(errno));
}

/* RESIZE frame: u16 cols, u16 rows (little-endian). Anything else is ignored. */
void pty_resize(struct tunnel *t, const uint8_t *p, size_t n) {
  if (!t->pty_pid || t->host_closed || n != 4) return;
  uint32_t cols = (uint32_t)p[0] | (uint32_t)p[1] << 8, rows = (uint32_t)p[2] | (uint32_t)p[3] << 8;
  if (cols == 0 || rows == 0) return;
  set_winsize(t->fd, cols, rows);
}

static int has_env(char **envp, size_t n, const char *name) {
  size_t l = strlen(name);
  for (size_t i = 0; i < n; i++)
    if (strncmp(envp[i], name, l) == 0 && envp[i][l] == '=') return 1;
  return 0;
}

/* Adds NAME=value unless the request already set NAME; returns the new count. */
static size_t env_default(char **envp, size_t n, const char *name, const char *value) {
  if (!value || has_env(envp, n, name) || n >= PTY_ENV_MAX) return n;
  size_t l = strlen(name) + strlen(value) + 2;
  char *s = malloc(l);
  if (!s) return n;
  snprintf(s, l, "%s=%s", name, value);
  envp[n] = s;
  return n + 1;
}

extern char **environ;

/* In the forked child: never returns. Errors are written to the terminal, where the user sees them. */
static void child_shell(int slave, const char *cwd, int have_uid, uint32_t uid, int have_gid, uint32_t gid,
                        const char *path, char **argv, char **envp) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL); /* SIGCHLD is blocked in the agent (signalfd) */
  signal(SIGPIPE, SIG_DFL);
  setsid(); /* own session: the terminal becomes its controlling tty, its group is killable */
  if (ioctl(slave, TIOCSCTTY, 0) < 0) dprintf(slave, "sandboxd-agent: TIOCSCTTY: %s\r\n", strerror(errno));
  dup2(slave, 0);
  dup2(slave, 1);
  dup2(slave, 2);
  if (slave > 2) close(slave);
  if (chdir(cwd) < 0 && chdir("/") < 0) _exit(126);
  if (have_uid || have_gid) {
    if (geteuid() == 0 && setgroups(0, NULL) < 0) _exit(126);
    if (have_gid && setgid((gid_t)gid) < 0) {
      dprintf(2, "sandboxd-agent: setgid %u: %s\r\n", gid, strerror(errno));
      _exit(126);
    }
    if (have_uid && setuid((uid_t)uid) < 0) {
      dprintf(2, "sandboxd-agent: setuid %u: %s\r\n", uid, strerror(errno));
      _exit(126);
    }
  }
  environ = envp;
  execv(path, argv);
  dprintf(2, "%s: %s\r\n", path, strerror(errno));
  _exit(127);
}

void op_pty(uint32_t stream, const uint8_t *p, size_t n) {
  if (n_tunnels >= MAX_TUNNELS) {
    respond_status(stream, EAGAIN, "pty: too many tunnels");
    return;
  }
  if (find_tunnel(stream) || find_exec(stream)) {
    respond_status(stream, EEXIST, "pty: stream id already in use");
    return;
  }
  uint32_t uid = 0, gid = 0, cols = 80, rows = 24;
  int have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &uid), have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &gid);
  if (have_uid < 0 || have_gid < 0 || tlv_get_u32(p, n, SBX_TAG_COLS, &cols) < 0 ||
      tlv_get_u32(p, n, SBX_TAG_ROWS, &rows) < 0 || cols == 0 || rows == 0 || cols > PTY_DIM_MAX ||
      rows > PTY_DIM_MAX) {
    respond_status(stream, EINVAL, "pty: UID/GID/COLS/ROWS malformed or out of range");
    return;
  }
  size_t nargv = 0, nenv = 0, off = 0, ia = 0, ie = 0;
  struct tlv t;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) nargv++;
    if (t.tag == SBX_TAG_ENV) nenv++;
  }
  if (nenv + 8 > PTY_ENV_MAX) {
    respond_status(stream, E2BIG, "pty: too many ENV entries");
    return;
  }
  /* The shell: ARGV if given, else bash if the image has it, else sh; started as a login shell
   * (argv[0] with a leading '-', as login(1) does) so it reads the profile files. */
  int default_shell = nargv == 0;
  char **argv = calloc(default_shell ? 2 : nargv + 1, sizeof *argv);
  char **envp = calloc(PTY_ENV_MAX + 1, sizeof *envp);
  char *path = NULL, *cwd = NULL;
  int master = -1, slave = -1;
  if (!argv || !envp) {
    respond_status(stream, ENOMEM, "pty: out of memory");
    goto out;
  }
  off = 0;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) argv[ia++] = tlv_strdup(&t);
    if (t.tag == SBX_TAG_ENV) envp[ie++] = tlv_strdup(&t);
  }
  if (default_shell) {
    path = strdup(access("/bin/bash", X_OK) == 0 ? "/bin/bash" : "/bin/sh");
    argv[0] = strdup(strcmp(path ? path : "", "/bin/bash") == 0 ? "-bash" : "-sh");
    nargv = 1;
  } else {
    path = argv[0] ? strdup(argv[0]) : NULL;
  }
  int oom = !path;
  for (size_t i = 0; i < nargv; i++) oom |= !argv[i];
  for (size_t i = 0; i < ie; i++) oom |= !envp[i];
  if (oom) {
    respond_status(stream, ENOMEM, "pty: out of memory");
    goto out;
  }
  /* A login-like environment: what the request did not set comes from the user's passwd entry
   * (read from the guest's own /etc/passwd) and sane terminal defaults. */
  struct passwd *pw = getpwuid(have_uid ? (uid_t)uid : getuid());
  ie = env_default(envp, ie, "TERM", "xterm-256color");
  ie = env_default(envp, ie, "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
  ie = env_default(envp, ie, "HOME", pw && pw->pw_dir && *pw->pw_dir ? pw->pw_dir : "/");
  ie = env_default(envp, ie, "USER", pw ? pw->pw_name : NULL);
  ie = env_default(envp, ie, "LOGNAME", pw ? pw->pw_name : NULL);
  ie = env_default(envp, ie, "SHELL", path);
  if (tlv_find(p, n, SBX_TAG_CWD, &t) && t.len)
    cwd = tlv_strdup(&t);
  else
    cwd = strdup(pw && pw->pw_dir && *pw->pw_dir ? pw->pw_dir : "/");
  if (!cwd) {
    respond_status(stream, ENOMEM, "pty: out of memory");
    goto out;
  }

  struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
  if (openpty(&master, &slave, NULL, NULL, &ws) < 0) {
    respond_errno(stream, errno, "pty: openpty", NULL);
    goto out;
  }
  fcntl(master, F_SETFD, FD_CLOEXEC);
  fcntl(slave, F_SETFD, FD_CLOEXEC); /* dup2 onto 0/1/2 in the child clears it there */
  fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK);
  struct tunnel *tn = calloc(1, sizeof *tn);
  if (!tn) {
    respond_status(stream, ENOMEM, "pty: out of memory");
    goto out;
  }
  pid_t pid = fork();
  if (pid < 0) {
    free(tn);
    respond_errno(stream, errno, "pty: fork", NULL);
    goto out;
  }
  if (pid == 0) child_shell(slave, cwd, have_uid, uid, have_gid, gid, path, argv, envp);
  close(slave);
  slave = -1;
  tn->stream = stream;
  tn->fd = master;
  tn->pty_pid = pid;
  master = -1;
  tn->send_credit = tn->recv_credit = SBX_TUNNEL_WINDOW;
  tunnel_link(tn);
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_u32(&b, SBX_TAG_PID, (uint32_t)pid);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);

out:
  if (master >= 0) close(master);
  if (slave >= 0) close(slave);
  if (argv)
    for (size_t i = 0; i < nargv; i++) free(argv[i]);
  if (envp)
    for (size_t i = 0; i < ie; i++) free(envp[i]);
  free(argv);
  free(envp);
  free(path);
  free(cwd);
}
