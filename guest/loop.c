/*
 * The loop: one thread, one poll() over the signalfd, the port, the egress listener, every exec's
 * pipes and every tunnel's socket. SIGCHLD is answered by reaping; timers (exec timeouts, output
 * drains, reconnect probes, tunnel connects and lingers) are deadlines folded into poll's
 * timeout. As PID 1 it never returns.
 */
#include "agent.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* After the command's own pid exits we wait this long for EOF on its pipes before answering.
 * Everything the command itself wrote is already in the pipe; this covers descendants that
 * are finishing at the same moment (e.g. the last stage of a pipeline the shell did not wait
 * for). A background daemon holding the pipe must not hold the answer, so the wait is short:
 * 20 ms is long enough for a runnable process to be scheduled and small next to a round trip. */
#define DRAIN_MS 20

int64_t mono_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}
int64_t mono_ms(void) { return mono_us() / 1000; }

enum { K_SIG, K_PORT, K_EGRESS, K_IN, K_OUT, K_ERR, K_DETACHED, K_TUN };

static void reap(int sigfd) {
  struct signalfd_siginfo si;
  while (sigfd >= 0 && read(sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
  }
  /* signalfd coalesces SIGCHLDs: reap everything that is dead. Orphans of every exec reparent
   * to us (PID 1, or subreaper in host mode); __WALL also reaps clone() children whose exit
   * signal is not SIGCHLD. */
  for (;;) {
    int st;
    pid_t pid = waitpid(-1, &st, WNOHANG | __WALL);
    if (pid <= 0) break;
    pty_exited(pid);
    for (struct exec *e = execs; e; e = e->next)
      if (e->pid == pid && !e->exited) {
        e->exited = 1;
        e->status = st;
        e->end_us = mono_us();
        break;
      }
  }
}

static void timers(void) {
  int64_t now = mono_ms();
  if (!connected && now >= next_probe_ms) probe_host();
  for (struct exec *e = execs; e; e = e->next)
    if (!e->exited && e->deadline_ms && now >= e->deadline_ms) {
      e->timed_out = 1;
      e->deadline_ms = 0;
      kill_group(e);
    }
  pty_timers(now);
  for (struct tunnel *t = tunnels; t; t = t->next) {
    if (t->dead) continue;
    if (t->connecting && now >= t->connect_deadline_ms)
      tunnel_connected(t, 1);
    else if (t->host_closed && now >= t->linger_deadline_ms)
      tunnel_end(t, 1, 0, NULL); /* the guest reader never drained: give up on the rest */
  }
}

/* Answer execs whose pid exited and whose pipes reached EOF or whose drain expired. */
static void complete_execs(void) {
  int64_t now = mono_ms();
  struct exec **pp = &execs;
  while (*pp) {
    struct exec *e = *pp;
    if (e->exited) {
      if (!e->draining) {
        e->draining = 1;
        e->drain_deadline_ms = now + DRAIN_MS;
        exec_read(e, 1, READ_PASS_MAX);
        exec_read(e, 2, READ_PASS_MAX);
      }
      if ((e->out_fd < 0 && e->err_fd < 0) || now >= e->drain_deadline_ms) {
        *pp = e->next;
        exec_finish(e);
        continue;
      }
    }
    pp = &e->next;
  }
}

int sigfd_missing;

static int poll_timeout(void) {
  int64_t now = mono_ms(), next = INT64_MAX;
  if (!connected) next = next_probe_ms;
  for (struct exec *e = execs; e; e = e->next) {
    if (!e->exited && e->deadline_ms && e->deadline_ms < next) next = e->deadline_ms;
    if (e->exited && e->draining && e->drain_deadline_ms < next) next = e->drain_deadline_ms;
  }
  for (struct tunnel *t = tunnels; t; t = t->next) {
    if (t->dead) continue;
    if (t->connecting && t->connect_deadline_ms < next) next = t->connect_deadline_ms;
    if (t->host_closed && t->linger_deadline_ms < next) next = t->linger_deadline_ms;
  }
  int64_t pty_next = pty_next_deadline();
  if (pty_next < next) next = pty_next;
  if (next == INT64_MAX) return sigfd_missing ? 100 : -1;
  if (next <= now) return 0;
  return next - now > 60000 ? 60000 : (int)(next - now);
}

void loop(int sigfd) {
  struct pollfd *pfd = NULL;
  struct {
    int kind;
    struct exec *e;
    struct tunnel *t;
  } *ref = NULL;
  size_t cap = 0;
  for (;;) { /* PID 1: forever */
    if (sigfd < 0) reap(sigfd); /* no signalfd (should not happen): reap by polling */
    timers();
    complete_execs();
    tunnels_sweep(); /* frees tunnels ended during the last pass, before the poll set is rebuilt */

    size_t need = 3 + 3 * (size_t)n_execs + (size_t)n_detached + (size_t)n_tunnel_slots, k = 0;
    if (need > cap) {
      struct pollfd *np = realloc(pfd, need * sizeof *pfd);
      if (np) pfd = np;
      void *nr = realloc(ref, need * sizeof *ref);
      if (nr) ref = nr;
      if (!np || !nr) {
        logmsg("out of memory for the poll set");
        usleep(100000); /* let memory pressure pass rather than spin */
        continue;
      }
      cap = need;
    }
#define ADD(fd_, ev_, kind_, e_)                                                                     \
  (pfd[k].fd = (fd_), pfd[k].events = (ev_), pfd[k].revents = 0, ref[k].kind = (kind_), ref[k].e = (e_), \
   ref[k].t = NULL, k++)
    ADD(sigfd, POLLIN, K_SIG, NULL);
    if (connected) ADD(port_fd, POLLIN | (outq_head ? POLLOUT : 0), K_PORT, NULL);
    if (egress_fd >= 0) ADD(egress_fd, POLLIN, K_EGRESS, NULL);
    int backpressure = connected && outq_bytes > OUTQ_STREAM_HIGH;
    for (struct exec *e = execs; e; e = e->next) {
      if (e->in_fd >= 0 && e->in.head) ADD(e->in_fd, POLLOUT, K_IN, e);
      int paused = backpressure && e->stream_output;
      if (e->out_fd >= 0 && !paused) ADD(e->out_fd, POLLIN, K_OUT, e);
      if (e->err_fd >= 0 && !paused) ADD(e->err_fd, POLLIN, K_ERR, e);
    }
    for (int i = 0; i < n_detached; i++) ADD(detached[i], POLLIN, K_DETACHED, NULL);
    for (struct tunnel *t = tunnels; t; t = t->next) {
      if (t->dead) continue;
      /* Read only with credit, and not while the port's queue is over its high mark: both are
       * the back-pressure that keeps PID 1's memory bounded. With nothing to wait for, the fd
       * stays out of the set (a POLLHUP there would only spin); it is looked at again when
       * credit comes or the host sends data. */
      short ev = t->connecting ? POLLOUT
                               : (short)((t->send_credit > 0 && !t->host_closed && !backpressure ? POLLIN : 0) |
                                         (t->in.head ? POLLOUT : 0));
      if (!ev) continue;
      ADD(t->fd, ev, K_TUN, NULL);
      ref[k - 1].t = t;
    }
#undef ADD

    int r = poll(pfd, k, poll_timeout());
    if (r < 0) {
      if (errno != EINTR) {
        logmsg("poll: %s", strerror(errno));
        usleep(10000); /* never spin on a persistent error */
      }
      continue;
    }
    /* Execs are only freed in complete_execs, so ref[].e stays valid during this pass. */
    for (size_t i = 0; i < k; i++) {
      short re = pfd[i].revents;
      if (!re) continue;
      struct exec *e = ref[i].e;
      switch (ref[i].kind) {
      case K_SIG:
        reap(sigfd);
        break;
      case K_PORT:
        if (!connected || pfd[i].fd != port_fd) break;
        if (re & (POLLIN | POLLHUP | POLLERR)) port_readable();
        if (connected && (re & POLLOUT)) flush_out();
        break;
      case K_EGRESS:
        egress_accept();
        break;
      case K_IN:
        if (e->in_fd == pfd[i].fd) stdin_pump(e);
        break;
      case K_OUT:
        if (e->out_fd == pfd[i].fd) exec_read(e, 1, READ_PASS_MAX);
        break;
      case K_ERR:
        if (e->err_fd == pfd[i].fd) exec_read(e, 2, READ_PASS_MAX);
        break;
      case K_TUN: {
        struct tunnel *t = ref[i].t;
        if (t->dead || t->fd != pfd[i].fd) break; /* ended earlier in this pass */
        if (t->connecting) {
          tunnel_connected(t, 0);
          break;
        }
        if (re & POLLOUT) tunnel_pump(t);
        if (!t->dead && (re & (POLLIN | POLLHUP | POLLERR))) {
          if (t->send_credit > 0 && !t->host_closed)
            tunnel_read(t); /* reads the data, the EOF or the error */
          else if (!t->in.head || (re & POLLERR))
            tunnel_pump(t); /* a write error ends it; an empty queue waits for credit */
        }
        break;
      }
      case K_DETACHED: {
        ssize_t n = read(pfd[i].fd, scratch, sizeof scratch);
        if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) break;
        close(pfd[i].fd); /* EOF: the last background writer is gone */
        for (int j = 0; j < n_detached; j++)
          if (detached[j] == pfd[i].fd) {
            detached[j] = detached[--n_detached];
            break;
          }
        break;
      }
      }
    }
  }
}
