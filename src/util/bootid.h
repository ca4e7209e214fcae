/*
 * The kernel's boot id: two processes that read the same one run on the
 * same booted machine, which is what a mover that maps or opens its
 * peer's memory by name (shm, cuda IPC) checks before it trusts an
 * offer.  Its 36 bytes travel in those movers' offers as they are.
 */
#ifndef KVF_UTIL_BOOTID_H
#define KVF_UTIL_BOOTID_H

#define KVF_BOOT_ID_LEN 36   /* "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", no NUL */

/* Read /proc/sys/kernel/random/boot_id into id.  @return 0, or -1 when it
 * cannot be read whole. */
int kvf_boot_id(char id[KVF_BOOT_ID_LEN]);

#endif /* KVF_UTIL_BOOTID_H */
