/* WRITE_FILE and READ_FILE: a whole file in one frame (bounded by SBX_MAX_PAYLOAD), so no file
 * op holds PID 1's loop for long. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* READ_FILE default and cap: the DATA must fit in one RESPONSE frame. */
#define READ_FILE_MAX (SBX_MAX_PAYLOAD - RESPONSE_RESERVE)

/* PATH absolute, or relative to CWD (default "/"). Caller frees. */
static char *resolve_path(const uint8_t *p, size_t n, uint32_t stream) {
  struct tlv t;
  if (!tlv_find(p, n, SBX_TAG_PATH, &t) || t.len == 0) {
    respond_status(stream, EINVAL, "missing PATH");
    return NULL;
  }
  char *path = tlv_strdup(&t);
  if (!path || path[0] == '/') return path;
  char *cwd = tlv_find(p, n, SBX_TAG_CWD, &t) && t.len ? tlv_strdup(&t) : strdup("/");
  char *full = NULL;
  if (cwd && asprintf(&full, "%s/%s", cwd, path) < 0) full = NULL;
  free(cwd);
  free(path);
  return full;
}

/* mkdir -p of the parents of `path` (0755; chowned when the request names an owner). */
static int make_parents(char *path, int have_uid, uint32_t uid, int have_gid, uint32_t gid) {
  for (char *s = path + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(path, 0755) == 0) {
      if ((have_uid || have_gid) && chown(path, have_uid ? uid : (uid_t)-1, have_gid ? gid : (gid_t)-1) < 0) {
        *s = '/';
        return -1;
      }
    } else if (errno != EEXIST) {
      *s = '/';
      return -1;
    }
    *s = '/';
  }
  return 0;
}

static int write_all(int fd, const uint8_t *d, size_t n) {
  while (n) {
    ssize_t w = write(fd, d, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    d += w;
    n -= (size_t)w;
  }
  return 0;
}

void op_write_file(uint32_t stream, const uint8_t *p, size_t n) {
  static unsigned counter;
  uint32_t mode = 0644, uid = 0, gid = 0;
  int have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &uid), have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &gid);
  if (tlv_get_u32(p, n, SBX_TAG_MODE, &mode) < 0 || have_uid < 0 || have_gid < 0) {
    respond_status(stream, EINVAL, "write_file: integer field of the wrong width");
    return;
  }
  struct tlv data = {0};
  tlv_find(p, n, SBX_TAG_DATA, &data);
  char *path = resolve_path(p, n, stream), *tmp = NULL;
  if (!path) return;
  char *slash = strrchr(path, '/');
  if (slash[1] == 0) {
    respond_errno(stream, EISDIR, "write_file", path);
    goto out;
  }
  if (make_parents(path, have_uid, uid, have_gid, gid) < 0) {
    respond_errno(stream, errno, "write_file: mkdir parents of", path);
    goto out;
  }
  /* Temp file in the same directory, then rename: readers see the old or the new file, never
   * a half-written one (docs: WRITE_FILE). */
  *slash = 0;
  int r = asprintf(&tmp, "%s/.%s.sbx-tmp-%d-%u", *path ? path : "", slash + 1, (int)getpid(), counter++);
  *slash = '/';
  if (r < 0) {
    tmp = NULL;
    respond_status(stream, ENOMEM, "write_file: out of memory");
    goto out;
  }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    respond_errno(stream, errno, "write_file: create", tmp);
    goto out;
  }
  int err = 0;
  if (write_all(fd, data.v, data.len) < 0) err = errno;
  /* chown before chmod: chown clears set-id bits. */
  if (!err && (have_uid || have_gid) && fchown(fd, have_uid ? uid : (uid_t)-1, have_gid ? gid : (gid_t)-1) < 0)
    err = errno;
  if (!err && fchmod(fd, mode & 07777) < 0) err = errno;
  if (close(fd) < 0 && !err) err = errno;
  if (!err && rename(tmp, path) < 0) err = errno;
  if (err) {
    unlink(tmp);
    respond_errno(stream, err, "write_file", path);
    goto out;
  }
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_u64(&b, SBX_TAG_SIZE, data.len);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
out:
  free(tmp);
  free(path);
}

void op_read_file(uint32_t stream, const uint8_t *p, size_t n) {
  uint32_t max = READ_FILE_MAX;
  if (tlv_get_u32(p, n, SBX_TAG_MAX_BYTES, &max) < 0) {
    respond_status(stream, EINVAL, "read_file: MAX_BYTES of the wrong width");
    return;
  }
  if (max > READ_FILE_MAX) max = READ_FILE_MAX; /* the DATA must fit one frame */
  char *path = resolve_path(p, n, stream);
  if (!path) return;
  uint8_t *data = NULL;
  /* O_NONBLOCK: a FIFO or a device must not block PID 1's loop; reads stop at EAGAIN. */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    respond_errno(stream, errno, "read_file", path);
    goto out;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || S_ISDIR(st.st_mode)) {
    int err = errno;
    respond_errno(stream, fstat(fd, &st) == 0 ? EISDIR : err, "read_file", path);
    close(fd);
    goto out;
  }
  /* One byte past the limit tells whether files without a size (procfs) were truncated. */
  data = malloc((size_t)max + 1);
  if (!data) {
    respond_status(stream, ENOMEM, "read_file: out of memory");
    close(fd);
    goto out;
  }
  size_t got = 0;
  while (got < (size_t)max + 1) {
    ssize_t r = read(fd, data + got, (size_t)max + 1 - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno != EAGAIN) {
      respond_errno(stream, errno, "read_file", path);
      close(fd);
      goto out;
    }
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  int truncated = got > max || (S_ISREG(st.st_mode) && (uint64_t)st.st_size > max);
  uint64_t size = S_ISREG(st.st_mode) && (uint64_t)st.st_size > got ? (uint64_t)st.st_size : got;
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  tlv_put(&b, SBX_TAG_DATA, data, got > max ? max : got);
  tlv_u64(&b, SBX_TAG_SIZE, size);
  tlv_u32(&b, SBX_TAG_TRUNCATED, (uint32_t)truncated);
  send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
out:
  free(data);
  free(path);
}
