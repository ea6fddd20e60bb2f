/* WRITE_FILE and READ_FILE: a whole file in one frame (bounded by SBX_MAX_PAYLOAD), so no file
 * op holds PID 1's loop for long; WRITE_FILE_STREAM: a file of any size in chunks; READ_FILE with
 * OFFSET: a file of any size one frame-sized piece per request. Each may run as FS_UID/FS_GID
 * (fsops.c). */
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
char *file_request_path(const uint8_t *p, size_t n, uint32_t stream) {
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

/* Where a write goes: the final path and the temp file beside it, open for writing. */
struct target {
  char *path, *tmp;
  int fd;
  uint32_t mode, uid, gid;
  int have_uid, have_gid;
  struct fs_identity id; /* whom the path lookups, the create and the rename are done as */
};

static void target_free(struct target *t) {
  free(t->tmp);
  free(t->path);
  t->tmp = t->path = NULL;
}

/* The request's PATH/CWD/MODE/UID/GID resolved, the parents made and the temp file created
 * (O_EXCL, O_NOFOLLOW, 0600 until the end). 0 on success; else the request is answered. */
static int target_open(uint32_t stream, const uint8_t *p, size_t n, struct target *t) {
  static unsigned counter;
  memset(t, 0, sizeof *t);
  t->fd = -1;
  t->mode = 0644;
  t->have_uid = tlv_get_u32(p, n, SBX_TAG_UID, &t->uid);
  t->have_gid = tlv_get_u32(p, n, SBX_TAG_GID, &t->gid);
  if (tlv_get_u32(p, n, SBX_TAG_MODE, &t->mode) < 0 || t->have_uid < 0 || t->have_gid < 0 ||
      fs_identity_read(p, n, &t->id) < 0) {
    respond_status(stream, EINVAL, "write_file: integer field of the wrong width");
    return -1;
  }
  t->path = file_request_path(p, n, stream);
  if (!t->path) return -1;
  fs_identity_enter(&t->id);
  char *slash = strrchr(t->path, '/');
  if (slash[1] == 0) {
    respond_errno(stream, EISDIR, "write_file", t->path);
    goto fail;
  }
  if (make_parents(t->path, t->have_uid, t->uid, t->have_gid, t->gid) < 0) {
    respond_errno(stream, errno, "write_file: mkdir parents of", t->path);
    goto fail;
  }
  /* Temp file in the same directory, then rename: readers see the old or the new file, never
   * a half-written one (docs: WRITE_FILE). */
  *slash = 0;
  int r = asprintf(&t->tmp, "%s/.%s.sbx-tmp-%d-%u", *t->path ? t->path : "", slash + 1, (int)getpid(),
                   counter++);
  *slash = '/';
  if (r < 0) {
    t->tmp = NULL;
    respond_status(stream, ENOMEM, "write_file: out of memory");
    goto fail;
  }
  t->fd = open(t->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (t->fd < 0) {
    respond_errno(stream, errno, "write_file: create", t->tmp);
    goto fail;
  }
  fs_identity_leave(&t->id);
  return 0;
fail:
  fs_identity_leave(&t->id);
  target_free(t);
  return -1;
}

/* Owner, mode, close and rename into place; answers SIZE, or the error after removing the temp
 * file. `err` is an earlier write's errno (0 none). Frees the target. */
static void target_finish(uint32_t stream, struct target *t, int err, uint64_t size) {
  fs_identity_enter(&t->id);
  /* chown before chmod: chown clears set-id bits. */
  if (!err && (t->have_uid || t->have_gid) &&
      fchown(t->fd, t->have_uid ? t->uid : (uid_t)-1, t->have_gid ? t->gid : (gid_t)-1) < 0)
    err = errno;
  if (!err && fchmod(t->fd, t->mode & 07777) < 0) err = errno;
  if (close(t->fd) < 0 && !err) err = errno;
  t->fd = -1;
  if (!err && rename(t->tmp, t->path) < 0) err = errno;
  if (err) unlink(t->tmp);
  fs_identity_leave(&t->id);
  if (err) {
    respond_errno(stream, err, "write_file", t->path);
  } else {
    struct buf b = {0};
    tlv_u32(&b, SBX_TAG_STATUS, 0);
    tlv_u64(&b, SBX_TAG_SIZE, size);
    send_buf(SBX_T_RESPONSE, stream, &b);
    buf_free(&b);
  }
  target_free(t);
}

/* Drops a target without answering: its temp file goes, the old file (if any) stays. */
static void target_abort(struct target *t) {
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
  if (t->tmp) unlink(t->tmp);
  target_free(t);
}

void op_write_file(uint32_t stream, const uint8_t *p, size_t n) {
  struct tlv data = {0};
  tlv_find(p, n, SBX_TAG_DATA, &data);
  struct target t;
  if (target_open(stream, p, n, &t) < 0) return;
  target_finish(stream, &t, write_all(t.fd, data.v, data.len) < 0 ? errno : 0, data.len);
}

/* ------------------------------------------------------------------------------------------ */
/* WRITE_FILE_STREAM: the content follows the REQUEST as STDIN frames, an empty one ends it. Each
 * chunk is written as it arrives, so a file is bounded by the guest's disk, not by a frame. A
 * write that fails (ENOSPC, EIO) is answered at once and its temp file removed; STDIN frames
 * still in flight for it are dropped as frames of an unknown stream. */

struct filew {
  struct filew *next;
  uint32_t stream;
  struct target t;
  uint64_t size;
};

static struct filew *filews;
static int n_filews;

static void filew_unlink(struct filew *w) {
  for (struct filew **pp = &filews; *pp; pp = &(*pp)->next) {
    if (*pp == w) {
      *pp = w->next;
      break;
    }
  }
  n_filews--;
  free(w);
}

int is_file_stream(uint32_t stream) {
  for (struct filew *w = filews; w; w = w->next)
    if (w->stream == stream) return 1;
  return 0;
}

void op_write_file_stream(uint32_t stream, const uint8_t *p, size_t n) {
  if (is_file_stream(stream)) {
    respond_status(stream, EBUSY, "write_file: stream already carries a file");
    return;
  }
  if (n_filews >= MAX_FILE_STREAMS) {
    respond_status(stream, EAGAIN, "write_file: too many streamed writes at once");
    return;
  }
  struct filew *w = calloc(1, sizeof *w);
  if (!w) {
    respond_status(stream, ENOMEM, "write_file: out of memory");
    return;
  }
  if (target_open(stream, p, n, &w->t) < 0) {
    free(w);
    return;
  }
  w->stream = stream;
  w->next = filews;
  filews = w;
  n_filews++;
}

void file_stream_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  struct filew *w = filews;
  while (w && w->stream != stream) w = w->next;
  if (!w) return;
  if (type == SBX_T_CANCEL) {
    target_abort(&w->t);
    respond_status(stream, ECANCELED, "write_file: cancelled");
    filew_unlink(w);
    return;
  }
  if (n == 0) { /* EOF: the file is complete */
    target_finish(stream, &w->t, 0, w->size);
    filew_unlink(w);
    return;
  }
  if (write_all(w->t.fd, p, n) < 0) {
    respond_errno(stream, errno, "write_file", w->t.path);
    target_abort(&w->t);
    filew_unlink(w);
    return;
  }
  w->size += n;
}

void file_streams_abort_all(void) {
  while (filews) {
    struct filew *w = filews;
    target_abort(&w->t);
    filew_unlink(w);
  }
}

void op_read_file(uint32_t stream, const uint8_t *p, size_t n) {
  uint32_t max = READ_FILE_MAX;
  uint64_t offset = 0;
  struct fs_identity id;
  if (tlv_get_u32(p, n, SBX_TAG_MAX_BYTES, &max) < 0 || tlv_get_u64(p, n, SBX_TAG_OFFSET, &offset) < 0 ||
      fs_identity_read(p, n, &id) < 0) {
    respond_status(stream, EINVAL, "read_file: integer field of the wrong width");
    return;
  }
  if (max > READ_FILE_MAX) max = READ_FILE_MAX; /* the DATA must fit one frame */
  char *path = file_request_path(p, n, stream);
  if (!path) return;
  uint8_t *data = NULL;
  /* O_NONBLOCK: a FIFO or a device must not block PID 1's loop; reads stop at EAGAIN. */
  fs_identity_enter(&id);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  int open_err = errno;
  fs_identity_leave(&id);
  errno = open_err;
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
  /* OFFSET: a large file is read in frame-sized pieces, each its own request. */
  if (offset && lseek(fd, (off_t)offset, SEEK_SET) < 0) {
    respond_errno(stream, errno, "read_file: seek in", path);
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
  int truncated = got > max || (S_ISREG(st.st_mode) && (uint64_t)st.st_size > offset + max);
  uint64_t size = S_ISREG(st.st_mode) && (uint64_t)st.st_size > offset + got ? (uint64_t)st.st_size
                                                                             : offset + got;
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
