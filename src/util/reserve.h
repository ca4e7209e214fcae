/*
 * A descriptor kept in reserve for an accept loop (libuv's trick).  A
 * level-triggered listener whose pending connection cannot be accepted
 * (EMFILE, ENFILE) stays readable, and its loop would spin on it: out of
 * descriptors, the reserve is closed, the pending connection accepted on
 * the descriptor that frees and closed at once, and the reserve opened
 * again.  The peer sees its connection closed, not a hung listener.
 */
#ifndef KVF_UTIL_RESERVE_H
#define KVF_UTIL_RESERVE_H

/* Open the reserve (/dev/null): its descriptor, or -1 (errno set). */
int kvf_reserve_open(void);

/*
 * Out of descriptors: shed the next connection pending on `listen_fd`
 * through the reserve *reserve_fd (reopened after; opened first if it was
 * -1).  @return 1 one was shed, 0 none is pending, -1 the reserve did not
 * help (none could be had, or accept failed otherwise: errno).
 */
int kvf_reserve_shed(int *reserve_fd, int listen_fd);

#endif /* KVF_UTIL_RESERVE_H */
