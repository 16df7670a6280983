/* ddp-sim test helper (never part of the roles): uname(2) as the simulated machine booted it.
 * Loaded into every process of an EL sim host through its /etc/ld.so.preload: the release field
 * becomes the kernel recorded in /var/lib/ddp-sim/booted-kernel (what ddp-sim-reboot "booted"), so
 * `uname -r`, Ansible's ansible_kernel and dkms's default kernel all see the EL kernel. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

int uname(struct utsname *buf) {
    if (syscall(SYS_uname, buf) != 0)
        return -1;
    int fd = open("/var/lib/ddp-sim/booted-kernel", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char r[sizeof buf->release];
    ssize_t n = read(fd, r, sizeof r - 1);
    close(fd);
    while (n > 0 && (r[n - 1] == '\n' || r[n - 1] == ' '))
        n--;
    if (n > 0) {
        r[n] = '\0';
        memcpy(buf->release, r, (size_t)n + 1);
        strcpy(buf->version, "#1 SMP PREEMPT_DYNAMIC Fri May 30 12:00:00 UTC 2025");
    }
    return 0;
}
