/*
 * Byte queues: data the agent accepted but could not write yet because the pipe or socket was
 * not ready (an exec's stdin, host data for a tunnel). Writers take from the head without
 * blocking and report what went out; each owner bounds its queue (STDIN_QUEUE_LIMIT, a tunnel's
 * credit window).
 */
#include "agent.h"

#include <stdlib.h>
#include <string.h>

int chunkq_push(struct chunkq *q, const uint8_t *p, size_t n) {
  struct chunk *c = malloc(sizeof *c + n);
  if (!c) return -1;
  c->next = NULL;
  c->len = n;
  c->off = 0;
  memcpy(c->data, p, n);
  if (q->tail)
    q->tail->next = c;
  else
    q->head = c;
  q->tail = c;
  q->bytes += n;
  return 0;
}

void chunkq_consumed(struct chunkq *q, size_t n) {
  struct chunk *c = q->head;
  c->off += n;
  if (c->off == c->len) {
    q->head = c->next;
    if (!q->head) q->tail = NULL;
    q->bytes -= c->len;
    free(c);
  }
}

void chunkq_clear(struct chunkq *q) {
  while (q->head) {
    struct chunk *c = q->head;
    q->head = c->next;
    free(c);
  }
  q->tail = NULL;
  q->bytes = 0;
}
