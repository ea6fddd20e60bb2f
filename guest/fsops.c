/* File ops beside WRITE_FILE/READ_FILE: LIST_DIR and REMOVE, and the filesystem identity every
 * file op may run with (FS_UID/FS_GID). As PID 1 the agent is root; a request that names an
 * identity has its path lookups, permission checks and new files done as that user instead
 * (setfsuid/setfsgid drop the filesystem capabilities while they are not 0), so a user's file
 * call cannot read or replace what the user could not. */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <unistd.h>

/* Supplementary groups PID 1 had before an identity was taken: root normally has none or one;
 * 64 is far past what an init process carries. */
#define SAVED_GROUPS_MAX 64
static gid_t saved_groups[SAVED_GROUPS_MAX];
static int n_saved_groups = -1;

int fs_identity_read(const uint8_t *p, size_t n, struct fs_identity *id) {
  memset(id, 0, sizeof *id);
  int hu = tlv_get_u32(p, n, SBX_TAG_FS_UID, &id->uid);
  int hg = tlv_get_u32(p, n, SBX_TAG_FS_GID, &id->gid);
  if (hu < 0 || hg < 0) return -1;
  id->set = hu == 1 && (id->uid != 0 || (hg == 1 && id->gid != 0));
  if (hg != 1) id->gid = id->uid; /* no group named: the user's own number */
  return 0;
}

void fs_identity_enter(const struct fs_identity *id) {
  if (!id->set) return;
  n_saved_groups = getgroups(SAVED_GROUPS_MAX, saved_groups);
  setgroups(0, NULL);
  setfsgid(id->gid);
  setfsuid(id->uid);
}

void fs_identity_leave(const struct fs_identity *id) {
  if (!id->set) return;
  setfsuid(0);
  setfsgid(0);
  if (n_saved_groups >= 0) setgroups((size_t)n_saved_groups, saved_groups);
  n_saved_groups = -1;
}

/* ------------------------------------------------------------------------------------------ */
/* LIST_DIR: one RESPONSE holds the entries; MAX_BYTES (default and cap LIST_DIR_MAX) bounds their
 * count and the frame bounds their bytes. Past either the answer says TRUNCATED: the host never
 * receives more than one frame for a directory, however large. */

#define LIST_DIR_MAX 10000

void op_list_dir(uint32_t stream, const uint8_t *p, size_t n) {
  uint32_t max = LIST_DIR_MAX;
  struct fs_identity id;
  if (tlv_get_u32(p, n, SBX_TAG_MAX_BYTES, &max) < 0 || fs_identity_read(p, n, &id) < 0) {
    respond_status(stream, EINVAL, "list_dir: integer field of the wrong width");
    return;
  }
  if (max > LIST_DIR_MAX) max = LIST_DIR_MAX;
  char *path = file_request_path(p, n, stream);
  if (!path) return;
  fs_identity_enter(&id);
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd < 0 ? NULL : fdopendir(fd);
  if (!d) {
    int err = errno;
    if (fd >= 0) close(fd);
    fs_identity_leave(&id);
    respond_errno(stream, err, "list_dir", path);
    free(path);
    return;
  }
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, 0);
  uint32_t count = 0;
  int truncated = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    size_t nl = strlen(de->d_name);
    /* Room for this entry, the TRUNCATED record and the frame's slack. */
    if (count >= max || b.len + 6 + SBX_ENTRY_HEADER_LEN + nl + 64 > SBX_MAX_PAYLOAD) {
      truncated = 1;
      break;
    }
    struct stat st;
    if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* gone meanwhile */
    /* d_name is at most 255 bytes (NAME_MAX). */
    uint8_t e[SBX_ENTRY_HEADER_LEN + 256];
    e[0] = S_ISREG(st.st_mode)   ? SBX_ENTRY_FILE
           : S_ISDIR(st.st_mode) ? SBX_ENTRY_DIR
           : S_ISLNK(st.st_mode) ? SBX_ENTRY_SYMLINK
                                 : SBX_ENTRY_OTHER;
    put32(e + 1, (uint32_t)st.st_mode & 07777);
    uint64_t size = (uint64_t)st.st_size;
    uint64_t mtime = (uint64_t)(int64_t)st.st_mtime;
    put32(e + 5, (uint32_t)size);
    put32(e + 9, (uint32_t)(size >> 32));
    put32(e + 13, (uint32_t)mtime);
    put32(e + 17, (uint32_t)(mtime >> 32));
    if (nl > 255) nl = 255;
    memcpy(e + SBX_ENTRY_HEADER_LEN, de->d_name, nl);
    tlv_put(&b, SBX_TAG_ENTRY, e, SBX_ENTRY_HEADER_LEN + nl);
    count++;
  }
  closedir(d);
  fs_identity_leave(&id);
  tlv_u32(&b, SBX_TAG_TRUNCATED, (uint32_t)truncated);
  if (b.failed) respond_status(stream, ENOMEM, "list_dir: out of memory");
  else send_buf(SBX_T_RESPONSE, stream, &b);
  buf_free(&b);
  free(path);
}

/* REMOVE: a file, a symlink (itself, never its target) or an empty directory. A directory with
 * entries is ENOTEMPTY: removing a tree is a command's job (`rm -r` in an exec), not PID 1's. */
void op_remove(uint32_t stream, const uint8_t *p, size_t n) {
  struct fs_identity id;
  if (fs_identity_read(p, n, &id) < 0) {
    respond_status(stream, EINVAL, "remove: integer field of the wrong width");
    return;
  }
  char *path = file_request_path(p, n, stream);
  if (!path) return;
  fs_identity_enter(&id);
  int r = unlink(path);
  if (r < 0 && (errno == EISDIR || errno == EPERM)) {
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) r = rmdir(path);
    else errno = EPERM;
  }
  int err = r < 0 ? errno : 0;
  fs_identity_leave(&id);
  if (err) respond_errno(stream, err, "remove", path);
  else respond_status(stream, 0, NULL);
  free(path);
}
