/*
 * sandboxd guest agent: PID 1 of the microVM's initramfs.
 *
 * Boot (only when PID 1): mount /dev, /proc, /sys; load the kernel modules the initramfs lists in
 * /etc/modules.order; mount the image disk (/dev/vda, ext4) and switch root into it so that every
 * exec sees the image's filesystem; open the virtio-serial port named "agent" once, for life.
 * Then serve the guest protocol (docs/guest-protocol.md, numbers in protocol.h) forever.
 *
 * Host test mode (not PID 1, or `--port PATH`): no boot duties; PATH is a unix socket the agent
 * connects to as a client, reconnecting as the guest would after a host disconnect. Commands run
 * directly on the host. This lets the exec/process semantics be tested in milliseconds.
 *
 * Shape: one thread, one poll() loop. SIGCHLD arrives through a signalfd; timers (exec timeouts,
 * output drains, reconnect probes) are deadlines folded into poll's timeout. Nothing in the loop
 * blocks for long: pipes and the port are non-blocking, file ops are bounded in size.
 *
 * PID 1 must never exit: the kernel panics when init dies ("Attempted to kill init"), taking
 * every command in the VM with it. So errors are logged (LOG frames + /dev/console) and the loop
 * goes on; there is no exit() on any path once we are PID 1.
 *
 * This file decides the mode and the startup order; the files and what each owns are listed in
 * agent.h.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

int host_mode;                    /* host test mode (above): set once, before anything else */
const char *port_path;            /* host mode: unix socket to connect to */
static uint32_t test_egress_port; /* host mode: egress proxy port (0: none; the host's 3128 may be taken) */
int console_fd = -1;              /* /dev/console (ttyS0) as PID 1, stderr in host mode */

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--port") == 0 && i + 1 < argc)
      port_path = argv[++i];
    else if (strcmp(argv[i], "--egress-port") == 0 && i + 1 < argc)
      test_egress_port = (uint32_t)strtoul(argv[++i], NULL, 10);
    else if (getpid() != 1) {
      fprintf(stderr, "usage: %s --port UNIX_SOCKET_PATH [--egress-port N]   (host test mode; as PID 1 no arguments)\n", argv[0]);
      return 2;
    }
  }
  host_mode = getpid() != 1 || port_path != NULL;
  if (host_mode && !port_path) {
    fprintf(stderr, "%s: not PID 1: host test mode needs --port UNIX_SOCKET_PATH\n", argv[0]);
    return 2;
  }
  if (!host_mode)
    early_boot();
  else
    ensure_std_fds(); /* a pipe must never land on fd 0-2 (see ensure_std_fds) */
  umask(022);
  /* SIGPIPE: a write to a closed pipe or socket must be an EPIPE, not our death. */
  signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, NULL);
  int sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (sigfd < 0) {
    logmsg("signalfd: %s", strerror(errno));
    if (host_mode) return 1;
    sigfd_missing = 1;
  }
  if (host_mode) {
    console_fd = fcntl(2, F_DUPFD_CLOEXEC, 3);
    /* Orphans of our execs reparent to us, as they would to PID 1 in the guest. */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    logmsg("host test mode, port %s", port_path);
  } else {
    boot();
  }
  if (!host_mode)
    egress_listen(SBX_EGRESS_PORT); /* after boot: lo is up */
  else if (test_egress_port)
    egress_listen(test_egress_port);
  loop(sigfd);
  return 0; /* not reached */
}
