/*
 * EXEC: running a command for the host. Each exec is a child in its own session; its stdin comes
 * from the request or from STDIN frames, its stdout/stderr are captured (bounded) or streamed,
 * and it is answered once its pid was reaped and its pipes drained (the loop drives both).
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

_Static_assert(SBX_EXEC_OUTPUT_MAX == SBX_MAX_PAYLOAD - RESPONSE_RESERVE, "exec output cap is a RESPONSE less its fields");

/* Default per-stream capture cap (docs: MAX_OUTPUT default 1 MiB). */
#define DEFAULT_MAX_OUTPUT (1u << 20)
/* Bound on execs in flight: each holds up to 3 fds, two capture buffers (<= 2 MiB) and a poll
 * slot; the host never needs more than a few dozen at once, and an unbounded count would let a
 * buggy host exhaust PID 1's memory. */
#define MAX_EXECS 256
/* Bound on pipes kept open after their exec answered (a background process still holds them).
 * Each costs an fd and a poll slot in PID 1; past the cap the oldest is closed (its writer may
 * then get SIGPIPE, which is the lesser evil than PID 1 running out of fds). */
#define MAX_DETACHED 128
/* Streamed stdin (STDIN frames) waiting for the child to read it. The protocol has no credit
 * for exec stdin, so past this the data is dropped and logged rather than grow PID 1 without
 * bound; hosts pace their writes. */
#define STDIN_QUEUE_LIMIT (16u << 20)
/* The final read before an answer is bounded too: a background writer may never stop. */
#define FINAL_READ_MAX (1u << 20)

struct exec *execs;
int n_execs;
int detached[MAX_DETACHED];
int n_detached;
uint8_t scratch[STREAM_CHUNK];

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

struct exec *find_exec(uint32_t stream) {
  for (struct exec *e = execs; e; e = e->next)
    if (e->stream == stream) return e;
  return NULL;
}

void kill_group(struct exec *e) {
  if (e->exited) return; /* reaped: its pid may be reused, never signal it */
  /* The command is a session and group leader; SIGKILL the whole group so descendants that
   * stayed in it (a grandchild `sleep`) die too. Before the child's setsid() ran the group
   * does not exist yet: kill the pid itself. */
  if (kill(-e->pid, SIGKILL) < 0) kill(e->pid, SIGKILL);
}

void stdin_push(struct exec *e, const uint8_t *p, size_t n) {
  if (e->in.bytes + n > STDIN_QUEUE_LIMIT) {
    logmsg("stream %u: stdin queue over %u bytes, dropping %zu bytes", e->stream, STDIN_QUEUE_LIMIT, n);
    return;
  }
  chunkq_push(&e->in, p, n); /* out of memory: dropped, like data over the limit */
}

/* Write queued stdin without blocking; close the pipe at EOF. The child closing its stdin
 * early (EPIPE; SIGPIPE is ignored in the agent) just discards the rest. */
void stdin_pump(struct exec *e) {
  while (e->in_fd >= 0 && e->in.head) {
    struct chunk *c = e->in.head;
    ssize_t n = write(e->in_fd, c->data + c->off, c->len - c->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;
      chunkq_clear(&e->in);
      close(e->in_fd);
      e->in_fd = -1;
      return;
    }
    chunkq_consumed(&e->in, (size_t)n);
  }
  if (e->in_fd >= 0 && !e->in.head && e->in_eof) {
    close(e->in_fd);
    e->in_fd = -1;
  }
}

/* Read one of the exec's pipes (1 stdout, 2 stderr), at most `limit` bytes this pass. Captured
 * output stops at max_output (the rest is read and discarded, flag set); streamed output goes
 * out as frames. */
void exec_read(struct exec *e, int which, size_t limit) {
  int *fdp = which == 1 ? &e->out_fd : &e->err_fd;
  struct buf *b = which == 1 ? &e->out : &e->err;
  int *trunc = which == 1 ? &e->out_trunc : &e->err_trunc;
  size_t done = 0;
  while (*fdp >= 0 && done < limit) {
    uint8_t *dst = scratch;
    size_t want = sizeof scratch;
    int capture = !e->stream_output && b->len < e->max_output;
    if (capture) {
      want = e->max_output - b->len;
      if (want > STREAM_CHUNK) want = STREAM_CHUNK;
      if (buf_reserve(b, want) < 0) {
        capture = 0;
        want = sizeof scratch;
      } else {
        dst = b->p + b->len;
      }
    }
    ssize_t n = read(*fdp, dst, want);
    if (n > 0) {
      done += (size_t)n;
      if (e->stream_output)
        send_frame(which == 1 ? SBX_T_STDOUT : SBX_T_STDERR, e->stream, scratch, (size_t)n);
      else if (capture)
        b->len += (size_t)n;
      else
        *trunc = 1;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    close(*fdp); /* EOF (every writer closed) or an error */
    *fdp = -1;
  }
}

static void detach_fd(int fd) {
  if (n_detached == MAX_DETACHED) {
    logmsg("more than %d detached pipes, closing the oldest", MAX_DETACHED);
    close(detached[0]);
    memmove(detached, detached + 1, sizeof detached[0] * (MAX_DETACHED - 1));
    n_detached--;
  }
  detached[n_detached++] = fd;
}

static void exec_free(struct exec *e) {
  chunkq_clear(&e->in);
  buf_free(&e->out);
  buf_free(&e->err);
  free(e);
}

/* The command's pid exited and its pipes drained (or the drain timed out): answer. */
void exec_finish(struct exec *e) {
  exec_read(e, 1, FINAL_READ_MAX);
  exec_read(e, 2, FINAL_READ_MAX);

  size_t o = e->out.len, r = e->err.len;
  if (!e->stream_output) {
    /* Both captures together must fit one RESPONSE frame (SBX_MAX_PAYLOAD); when they do not,
     * the smaller keeps what it has up to half and the larger gets the rest. */
    size_t budget = SBX_EXEC_OUTPUT_MAX, half = budget / 2;
    if (o + r > budget) {
      if (o <= half)
        r = budget - o;
      else if (r <= half)
        o = budget - r;
      else
        o = half, r = budget - half;
    }
    if (o < e->out.len) e->out_trunc = 1;
    if (r < e->err.len) e->err_trunc = 1;
  }

  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_u32(&b, SBX_TAG_PID, (uint32_t)e->pid);
  tlv_u64(&b, SBX_TAG_DURATION_US, (uint64_t)(e->end_us - e->start_us));
  if (WIFEXITED(e->status)) {
    tlv_u32(&b, SBX_TAG_EXIT_CODE, (uint32_t)WEXITSTATUS(e->status));
  } else if (WIFSIGNALED(e->status)) {
    tlv_u32(&b, SBX_TAG_SIGNAL, (uint32_t)WTERMSIG(e->status));
  }
  tlv_u32(&b, SBX_TAG_TIMED_OUT, (uint32_t)e->timed_out);
  tlv_u32(&b, SBX_TAG_STDOUT_TRUNC, (uint32_t)e->out_trunc);
  tlv_u32(&b, SBX_TAG_STDERR_TRUNC, (uint32_t)e->err_trunc);
  if (!e->stream_output) {
    tlv_put(&b, SBX_TAG_STDOUT, e->out.p, o);
    tlv_put(&b, SBX_TAG_STDERR, e->err.p, r);
  }
  if (e->has_seed) tlv_u32(&b, SBX_TAG_SEED_ACK, (uint32_t)e->seed_ack);
  send_buf(SBX_T_RESPONSE, e->stream, &b);
  buf_free(&b);

  /* Pipes still open are held by background processes the command left behind. Keep reading
   * and discarding so they never block or get SIGPIPE (docs: they survive). */
  if (e->out_fd >= 0) detach_fd(e->out_fd);
  if (e->err_fd >= 0) detach_fd(e->err_fd);
  if (e->in_fd >= 0) close(e->in_fd);
  n_execs--;
  exec_free(e);
}

extern char **environ;

/* In the forked child: never returns. Only the child's own state is touched. */
static void child_exec(struct exec *e, int in_rd, int out_wr, int err_wr, const char *cwd, int have_uid,
                       uint32_t uid, int have_gid, uint32_t gid, char **argv, char **envp) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL); /* SIGCHLD is blocked in the agent (signalfd) */
  signal(SIGPIPE, SIG_DFL);              /* ignored dispositions survive exec: restore */
  setsid();                              /* own session and process group (docs: EXEC) */
  int nul = -1;
  if (in_rd < 0) in_rd = nul = open("/dev/null", O_RDONLY);
  if (in_rd >= 0) dup2(in_rd, 0);
  dup2(out_wr, 1);
  dup2(err_wr, 2);
  if (nul > 2) close(nul);
  /* Every other fd of the agent is O_CLOEXEC. */
  if (chdir(cwd) < 0) {
    dprintf(2, "sandboxd-agent: chdir %s: %s\n", cwd, strerror(errno));
    _exit(126);
  }
  if (have_uid || have_gid) {
    if (geteuid() == 0 && setgroups(0, NULL) < 0) {
      dprintf(2, "sandboxd-agent: setgroups: %s\n", strerror(errno));
      _exit(126);
    }
    if (have_gid && setgid((gid_t)gid) < 0) {
      dprintf(2, "sandboxd-agent: setgid %u: %s\n", gid, strerror(errno));
      _exit(126);
    }
    if (have_uid && setuid((uid_t)uid) < 0) {
      dprintf(2, "sandboxd-agent: setuid %u: %s\n", uid, strerror(errno));
      _exit(126);
    }
  }
  (void)e;
  /* musl's execvpe searches the PATH of the *calling* process, not of envp: install envp as
   * our environment first so execvp searches the PATH the host sent (docs: EXEC ARGV). */
  environ = envp;
  execvp(argv[0], argv);
  int err = errno;
  if (err == ENOENT)
    dprintf(2, "%s: command not found\n", argv[0]);
  else
    dprintf(2, "%s: %s\n", argv[0], strerror(err));
  _exit(err == ENOENT ? 127 : 126); /* as a shell does */
}

void op_exec(uint32_t stream, const uint8_t *p, size_t n) {
  if (n_execs >= MAX_EXECS) {
    respond_status(stream, EAGAIN, "too many execs in flight");
    return;
  }
  if (find_exec(stream) || find_tunnel(stream)) {
    respond_status(stream, EEXIST, "stream id already in use by a running exec or tunnel");
    return;
  }
  size_t nargv = 0, nenv = 0, off = 0;
  struct tlv t;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) nargv++;
    if (t.tag == SBX_TAG_ENV) nenv++;
  }
  if (nargv == 0) {
    respond_status(stream, EINVAL, "exec: empty argv");
    return;
  }
  uint32_t uid = 0, gid = 0, timeout_ms = 0, max_output = DEFAULT_MAX_OUTPUT, flags = 0;
  int have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &uid);
  int have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &gid);
  if (have_uid < 0 || have_gid < 0 || tlv_get_u32(p, n, SBX_TAG_TIMEOUT_MS, &timeout_ms) < 0 ||
      tlv_get_u32(p, n, SBX_TAG_MAX_OUTPUT, &max_output) < 0 || tlv_get_u32(p, n, SBX_TAG_STREAM, &flags) < 0) {
    respond_status(stream, EINVAL, "exec: integer field of the wrong width");
    return;
  }
  if (max_output > SBX_MAX_PAYLOAD) max_output = SBX_MAX_PAYLOAD;

  char **argv = calloc(nargv + 1, sizeof *argv), **envp = calloc(nenv + 1, sizeof *envp);
  char *cwd = NULL;
  struct exec *e = calloc(1, sizeof *e);
  int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  if (!argv || !envp || !e) {
    respond_status(stream, ENOMEM, "exec: out of memory");
    goto out;
  }
  size_t ia = 0, ie = 0;
  off = 0;
  while (tlv_next(p, n, &off, &t) == 1) {
    if (t.tag == SBX_TAG_ARGV) argv[ia++] = tlv_strdup(&t);
    if (t.tag == SBX_TAG_ENV) envp[ie++] = tlv_strdup(&t);
  }
  cwd = tlv_find(p, n, SBX_TAG_CWD, &t) && t.len ? tlv_strdup(&t) : strdup("/");
  int oom = !cwd;
  for (size_t i = 0; i < nargv; i++) oom |= !argv[i];
  for (size_t i = 0; i < nenv; i++) oom |= !envp[i];
  if (oom) {
    respond_status(stream, ENOMEM, "exec: out of memory");
    goto out;
  }
  /* A bad working directory is the request's fault, not the command's: answer with an error
   * status instead of running anything. */
  struct stat st;
  if (stat(cwd, &st) < 0) {
    respond_errno(stream, errno, "exec: cwd", cwd);
    goto out;
  }
  if (!S_ISDIR(st.st_mode)) {
    respond_errno(stream, ENOTDIR, "exec: cwd", cwd);
    goto out;
  }

  e->stream = stream;
  e->in_fd = e->out_fd = e->err_fd = -1;
  e->max_output = max_output;
  e->stream_output = (flags & 1) != 0;
  e->stream_stdin = (flags & 2) != 0;

  /* SEED: mixed like ENTROPY before the command runs, so it sees fresh randomness. */
  if (tlv_find(p, n, SBX_TAG_SEED, &t)) {
    e->has_seed = 1;
    e->seed_ack = mix_entropy(t.v, t.len) == 0;
  }

  struct tlv stdin_tlv;
  int have_stdin = tlv_find(p, n, SBX_TAG_STDIN, &stdin_tlv);
  if ((have_stdin || e->stream_stdin) && pipe2(in_pipe, O_CLOEXEC) < 0) {
    respond_errno(stream, errno, "exec: pipe", NULL);
    goto out;
  }
  if (pipe2(out_pipe, O_CLOEXEC) < 0 || pipe2(err_pipe, O_CLOEXEC) < 0) {
    respond_errno(stream, errno, "exec: pipe", NULL);
    goto out;
  }

  e->start_us = mono_us();
  pid_t pid = fork();
  if (pid < 0) {
    respond_errno(stream, errno, "exec: fork", NULL);
    goto out;
  }
  if (pid == 0)
    child_exec(e, in_pipe[0], out_pipe[1], err_pipe[1], cwd, have_uid, uid, have_gid, gid, argv, envp);

  e->pid = pid;
  close(out_pipe[1]);
  close(err_pipe[1]);
  e->out_fd = out_pipe[0];
  e->err_fd = err_pipe[0];
  set_nonblock(e->out_fd);
  set_nonblock(e->err_fd);
  if (in_pipe[0] >= 0) {
    close(in_pipe[0]);
    e->in_fd = in_pipe[1];
    set_nonblock(e->in_fd);
    if (have_stdin) {
      if (stdin_tlv.len) stdin_push(e, stdin_tlv.v, stdin_tlv.len);
      /* Inline stdin is the whole stdin, unless the host also streams more. */
      if (!e->stream_stdin) e->in_eof = 1;
    }
  }
  in_pipe[0] = in_pipe[1] = out_pipe[0] = out_pipe[1] = err_pipe[0] = err_pipe[1] = -1;
  if (timeout_ms) e->deadline_ms = mono_ms() + timeout_ms;
  e->next = execs;
  execs = e;
  n_execs++;
  /* Before any output of the command (read by the loop later): the host can answer its caller
   * that the command runs, even one that stays silent, and name it by its pid (u32 LE). */
  if (flags & SBX_STREAM_STARTED) {
    uint8_t pid_le[4];
    put32(pid_le, (uint32_t)pid);
    send_frame(SBX_T_STARTED, stream, pid_le, sizeof pid_le);
  }
  stdin_pump(e);
  e = NULL; /* owned by the list now */

out:
  for (int i = 0; i < 2; i++) {
    if (in_pipe[i] >= 0) close(in_pipe[i]);
    if (out_pipe[i] >= 0) close(out_pipe[i]);
    if (err_pipe[i] >= 0) close(err_pipe[i]);
  }
  if (e) exec_free(e);
  if (argv)
    for (size_t i = 0; i < nargv; i++) free(argv[i]);
  if (envp)
    for (size_t i = 0; i < nenv; i++) free(envp[i]);
  free(argv);
  free(envp);
  free(cwd);
}
