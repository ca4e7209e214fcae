/* The kernel's boot id: see bootid.h. */
#include "util/bootid.h"

#include <stdio.h>

int kvf_boot_id(char id[KVF_BOOT_ID_LEN])
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL)
        return -1;
    size_t n = fread(id, 1, KVF_BOOT_ID_LEN, f);
    fclose(f);
    return n == KVF_BOOT_ID_LEN ? 0 : -1;
}
