/*
 * kvm-hold: opens /dev/kvm, creates one VM (no vCPU) and sleeps until killed.
 *
 * Rig 2 (ENVIRONMENT.md): Linux patches kernel text (static keys such as the preempt-notifier key
 * used by finish_task_switch) when the first KVM VM is created and when the last one is
 * destroyed. Under multi-threaded QEMU TCG the other vCPU can run a stale copy of the patched code
 * and L1 dies with "Oops: int3". Keeping one idle VM open for the whole run means the key is
 * flipped once, at boot, and never again. Built static by images/build-l1.sh.
 */
#include <fcntl.h>
#include <linux/kvm.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <unistd.h>

int main(void)
{
    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (kvm < 0) {
        perror("kvm-hold: open /dev/kvm");
        return 1;
    }
    int api = ioctl(kvm, KVM_GET_API_VERSION, 0);
    int vm = ioctl(kvm, KVM_CREATE_VM, 0);
    if (vm < 0) {
        perror("kvm-hold: KVM_CREATE_VM");
        return 1;
    }
    printf("kvm-hold: api=%d vm_fd=%d pid=%d\n", api, vm, (int)getpid());
    fflush(stdout);
    for (;;)
        pause();
}
