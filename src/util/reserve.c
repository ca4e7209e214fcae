/* A descriptor kept in reserve for an accept loop: see reserve.h. */
#include "util/reserve.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

int kvf_reserve_open(void)
{
    return open("/dev/null", O_RDONLY | O_CLOEXEC);
}

int kvf_reserve_shed(int *reserve_fd, int listen_fd)
{
    if (*reserve_fd < 0 && (*reserve_fd = kvf_reserve_open()) < 0)
        return -1;
    close(*reserve_fd);
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    int err = errno;
    if (fd >= 0)
        close(fd);
    *reserve_fd = kvf_reserve_open();
    if (fd >= 0)
        return 1;
    errno = err;
    return err == EAGAIN || err == EWOULDBLOCK ? 0 : -1;
}
