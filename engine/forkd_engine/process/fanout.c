/* forkd's fan-out loop: a template's fork of a spawn's children, in C.
 *
 *   int forkd_fanout(int n, int pidns_fd, int *pids, before, after_parent, after_child)
 *
 * Each child is the first process (PID 1) of a pid namespace of its own: unshare(CLONE_NEWPID),
 * fork(), then setns() back to ours (pidns_fd) for the next one. Loaded into the template with
 * ctypes.PyDLL (the GIL stays held, as os.fork holds it), and given CPython's own fork hooks
 * (PyOS_BeforeFork, PyOS_AfterFork_Parent, PyOS_AfterFork_Child): the interpreter sees one fork
 * per child exactly as os.fork() makes it, each child running its after-fork hooks first thing.
 *
 * Why in C: a Python loop writes the interpreter's memory between two forks (reference counts,
 * ctypes arguments, frames), and every page it writes after a child's fork is one that child no
 * longer shares with its siblings (its private memory) and one more copy-on-write for the
 * template; the loop's own CPU is paid per child too.
 *
 * Returns, in a child, its index counted from 1; in the template 0 once all n are forked, or
 * -errno of the call that failed (pids[i] is 0 for each child not made).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <unistd.h>

typedef void (*hook)(void);

int forkd_fanout(int n, int pidns_fd, int *pids, hook before, hook after_parent, hook after_child) {
    int err = 0;
    before();
    for (int i = 0; i < n && !err; i++) {
        if (unshare(CLONE_NEWPID) != 0) {
            err = errno;
            break;
        }
        pid_t pid = fork();
        if (pid == 0) {
            after_child();
            return i + 1;
        }
        if (pid < 0)
            err = errno;
        else
            pids[i] = pid;
        if (setns(pidns_fd, CLONE_NEWPID) != 0 && !err)   /* our own namespace again, for the next */
            err = errno;
    }
    after_parent();
    return -err;
}
