/* What each frame from the host asks for: HELLO, the REQUEST ops, and the frames of running execs,
 * streamed file writes and tunnels, each routed to the file that owns it. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "sandboxd-agent 0.1.0"

static void op_hello(void) {
  char boot_id[64] = "";
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t r = read(fd, boot_id, sizeof boot_id - 1);
    close(fd);
    if (r > 0) {
      boot_id[r] = 0;
      boot_id[strcspn(boot_id, "\n")] = 0;
    }
  }
  struct timespec ts;
  clock_gettime(CLOCK_BOOTTIME, &ts); /* the clock behind /proc/uptime */
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_PROTO_VERSION, SBX_VERSION);
  tlv_str(&b, SBX_TAG_AGENT_VERSION, AGENT_VERSION);
  tlv_str(&b, SBX_TAG_BOOT_ID, boot_id);
  tlv_u64(&b, SBX_TAG_UPTIME_MS, (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000);
  send_buf(SBX_T_HELLO, 0, &b);
  buf_free(&b);
}

static void op_request(uint32_t stream, const uint8_t *p, size_t n) {
  if (stream == 0) {
    logmsg("REQUEST on stream 0 ignored");
    return;
  }
  uint32_t op = 0;
  if (!tlv_valid(p, n) || tlv_get_u32(p, n, SBX_TAG_OP, &op) != 1) {
    respond_status(stream, EINVAL, "malformed request (TLV list or OP)");
    return;
  }
  switch (op) {
  case SBX_OP_PING:
    respond_status(stream, 0, NULL);
    return;
  case SBX_OP_EXEC:
    op_exec(stream, p, n);
    return;
  case SBX_OP_WRITE_FILE:
    op_write_file(stream, p, n);
    return;
  case SBX_OP_WRITE_FILE_STREAM:
    op_write_file_stream(stream, p, n);
    return;
  case SBX_OP_READ_FILE:
    op_read_file(stream, p, n);
    return;
  case SBX_OP_LIST_DIR:
    op_list_dir(stream, p, n);
    return;
  case SBX_OP_REMOVE:
    op_remove(stream, p, n);
    return;
  case SBX_OP_ENTROPY:
    op_entropy(stream, p, n);
    return;
  case SBX_OP_SET_CLOCK:
    op_set_clock(stream, p, n);
    return;
  case SBX_OP_SET_HOSTNAME:
    op_set_hostname(stream, p, n);
    return;
  case SBX_OP_CONNECT:
    op_connect(stream, p, n);
    return;
  case SBX_OP_PTY:
    op_pty(stream, p, n);
    return;
  case SBX_OP_SYNC:
    sync();
    respond_status(stream, 0, NULL);
    return;
  default:
    respond_status(stream, ENOSYS, "unknown op");
    return;
  }
}

void dispatch(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  struct exec *e;
  switch (type) {
  case SBX_T_HELLO:
    /* A HELLO starts the host afresh: tunnels it knew are gone on its side (docs "Tunnels"). */
    tunnels_close_all("host said HELLO");
    file_streams_abort_all();
    op_hello();
    return;
  case SBX_T_REQUEST:
    op_request(stream, p, n);
    return;
  case SBX_T_STDIN:
    if (is_file_stream(stream)) {
      file_stream_frame(type, stream, p, n);
      return;
    }
    e = find_exec(stream);
    if (!e || !e->stream_stdin || e->in_fd < 0) return; /* late or unknown: drop */
    if (n == 0)
      e->in_eof = 1;
    else
      stdin_push(e, p, n);
    stdin_pump(e);
    return;
  case SBX_T_CANCEL:
    if (is_file_stream(stream)) {
      file_stream_frame(type, stream, p, n);
      return;
    }
    e = find_exec(stream);
    if (e && !e->exited) {
      e->cancelled = 1;
      kill_group(e);
    }
    return;
  case SBX_T_DATA:
  case SBX_T_CLOSE:
  case SBX_T_CREDIT:
  case SBX_T_RESIZE:
    tunnel_frame(type, stream, p, n);
    return;
  default:
    logmsg("unknown frame type %u on stream %u ignored", type, stream);
    return;
  }
}
