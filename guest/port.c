/*
 * The port to the host: the connection state, the output queue every frame to the host goes
 * through, log lines, answers, finding and (re)connecting to the host, and reading the port into
 * the frame decoder. In the VM the port is the virtio-serial port named "agent"; in host test
 * mode a unix socket the agent connects to.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* While no host is connected the virtio port reports POLLHUP continuously and there is no poll
 * event for "host connected again", so we look again every 50 ms: cheap (one poll syscall),
 * and it adds at most 50 ms to the first answer after a restore (~150 ms of TCG warm-up
 * anyway). In host mode the same period paces reconnect attempts to the unix socket. */
#define RECONNECT_MS 50
/* When the "agent" port does not exist yet (module still probing) we look again this often. */
#define PORT_RETRY_MS 1000

int port_fd = -1;
int connected;         /* a host is attached to the port */
int64_t next_probe_ms; /* when to look for a host again while disconnected */

struct outframe {
  struct outframe *next;
  size_t len, off;
  uint8_t data[];
};
struct outframe *outq_head;
static struct outframe *outq_tail;
size_t outq_bytes;

void logmsg(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line) n = sizeof line - 1;
  if (console_fd >= 0) {
    char out[600];
    int m = snprintf(out, sizeof out, "sandboxd-agent: %s\n", line);
    if (m > 0) {
      /* The console is a blocking serial line; a short write loses the rest of one log line,
       * which is acceptable for diagnostics. */
      ssize_t w = write(console_fd, out, (size_t)m < sizeof out ? (size_t)m : sizeof out - 1);
      (void)w;
    }
  }
  send_frame(SBX_T_LOG, 0, (const uint8_t *)line, (size_t)n);
}

static void outq_clear(void) {
  while (outq_head) {
    struct outframe *f = outq_head;
    outq_head = f->next;
    free(f);
  }
  outq_tail = NULL;
  outq_bytes = 0;
}

/* Host went away (EOF/POLLHUP/write error). Execs keep running; what they produce meanwhile
 * is dropped (docs "Reconnects"); partial input is discarded. */
static void host_lost(const char *why, int err) {
  if (!connected) return;
  connected = 0;
  outq_clear();
  decoder_reset();
  tunnels_close_all("host disconnected"); /* the host's side of them is gone */
  file_streams_abort_all();               /* their content will not arrive */
  next_probe_ms = mono_ms() + RECONNECT_MS;
  if (host_mode && port_fd >= 0) {
    close(port_fd);
    port_fd = -1;
  }
  logmsg("host disconnected (%s%s%s)", why, err ? ": " : "", err ? strerror(err) : "");
}

void flush_out(void) {
  while (connected && outq_head) {
    struct outframe *f = outq_head;
    ssize_t n = write(port_fd, f->data + f->off, f->len - f->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return; /* port full: poll for POLLOUT */
      host_lost("write", errno);
      return;
    }
    f->off += (size_t)n;
    if (f->off == f->len) {
      outq_head = f->next;
      if (!outq_head) outq_tail = NULL;
      outq_bytes -= f->len;
      free(f);
    }
  }
}

void send_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  if (!connected || port_fd < 0) return; /* no host: dropped (docs "Reconnects") */
  if (n > SBX_MAX_PAYLOAD) n = SBX_MAX_PAYLOAD; /* callers bound payloads; never exceed the limit */
  if (type == SBX_T_LOG && outq_bytes > OUTQ_LOG_LIMIT) return;
  struct outframe *f = malloc(sizeof *f + SBX_HEADER_LEN + n);
  if (!f) return;
  f->next = NULL;
  f->off = 0;
  f->len = SBX_HEADER_LEN + n;
  frame_header(f->data, type, stream, (uint32_t)n);
  if (n) memcpy(f->data + SBX_HEADER_LEN, p, n);
  if (outq_tail)
    outq_tail->next = f;
  else
    outq_head = f;
  outq_tail = f;
  outq_bytes += f->len;
  flush_out();
}

void send_buf(uint8_t type, uint32_t stream, struct buf *b) {
  if (b->failed) {
    /* Out of memory building the answer: still answer, minimally, so the host does not wait. */
    struct buf e = {0};
    tlv_u32(&e, SBX_TAG_STATUS, ENOMEM);
    tlv_str(&e, SBX_TAG_ERROR, "out of memory building response");
    send_frame(type, stream, e.p, e.len);
    buf_free(&e);
    return;
  }
  send_frame(type, stream, b->p, b->len);
}

void respond_status(uint32_t stream, int err, const char *msg) {
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, (uint32_t)err);
  if (err && msg) tlv_str(&b, SBX_TAG_ERROR, msg);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
}

void respond_errno(uint32_t stream, int err, const char *what, const char *path) {
  char msg[600];
  snprintf(msg, sizeof msg, "%s%s%s: %s", what, path ? " " : "", path ? path : "", strerror(err));
  respond_status(stream, err, msg);
}

/* ------------------------------------------------------------------------------------------ */
/* finding and (re)connecting to the host */

/* /sys/class/virtio-ports/<vportNpM>/name holds the name QEMU gave the port ("agent"). */
static int find_agent_port(char *dev, size_t devlen) {
  DIR *d = opendir("/sys/class/virtio-ports");
  if (!d) return -1;
  struct dirent *de;
  int found = -1;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    char p[512], name[64];
    snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t n = read(fd, name, sizeof name - 1);
    close(fd);
    if (n <= 0) continue;
    name[n] = 0;
    if (name[n - 1] == '\n') name[n - 1] = 0;
    if (strcmp(name, "agent") == 0) {
      snprintf(dev, devlen, "/dev/%s", de->d_name);
      found = 0;
      break;
    }
  }
  closedir(d);
  return found;
}

/* Opened once for the agent's whole life: a second open of a virtio port gets EBUSY. */
int open_agent_port(int quiet) {
  char dev[300];
  if (find_agent_port(dev, sizeof dev) < 0) {
    if (!quiet) logmsg("virtio port \"agent\" not found yet");
    return -1;
  }
  int fd = open(dev, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (!quiet) logmsg("open %s: %s", dev, strerror(errno));
    return -1;
  }
  port_fd = fd;
  logmsg("agent port %s", dev);
  return 0;
}

/* Called while disconnected, at most every RECONNECT_MS. */
void probe_host(void) {
  next_probe_ms = mono_ms() + RECONNECT_MS;
  if (host_mode) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", port_path);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
      close(fd); /* not listening yet (ENOENT/ECONNREFUSED) or backlog full: try again later */
      return;
    }
    port_fd = fd;
  } else {
    if (port_fd < 0 && open_agent_port(1) < 0) {
      next_probe_ms = mono_ms() + PORT_RETRY_MS;
      return;
    }
    struct pollfd p = {.fd = port_fd, .events = POLLIN};
    if (poll(&p, 1, 0) < 0) return;
    /* virtio_console reports POLLHUP for as long as host_connected is false. */
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return;
  }
  connected = 1;
  decoder_reset(); /* drop any partial input from before the disconnect */
  logmsg("host connected");
}

void port_readable(void) {
  static uint8_t rbuf[65536];
  /* At most 16 reads per wakeup so a flood of input cannot starve the execs' pipes. */
  for (int i = 0; i < 16 && connected; i++) {
    ssize_t n = read(port_fd, rbuf, sizeof rbuf);
    if (n > 0) {
      feed(rbuf, (size_t)n);
      continue;
    }
    if (n == 0) {
      host_lost("EOF", 0);
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return;
    host_lost("read", errno);
    return;
  }
}
