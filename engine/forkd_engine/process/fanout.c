/* forkd's fan-out loop: a template's fork of a spawn's children, in C.
 *
 *   int forkd_fanout(int n, int pidns_fd, int *pids, const char *init,
 *                    before, after_parent, after_child)
 *
 * Each child is the first process (PID 1) of a pid namespace of its own: unshare(CLONE_NEWPID),
 * fork(), then setns() back to ours (pidns_fd) for the next one. That first process forks the
 * sandbox's agent and execs forkd-init (``init``) in its place, all here, before any Python runs in
 * it (as inside.hand_pid1_to_init does for a branch). Loaded into the template with ctypes.PyDLL
 * (the GIL stays held, as os.fork holds it), and given CPython's own fork hooks (PyOS_BeforeFork,
 * PyOS_AfterFork_Parent, PyOS_AfterFork_Child): the interpreter sees one fork per agent exactly as
 * os.fork() makes it, each agent running its after-fork hooks first thing.
 *
 * Why in C: Python between two forks writes the interpreter's memory (reference counts, frames,
 * ctypes arguments, after-fork hooks), and every page written in a process whose copy another
 * then holds alone is private memory of that copy: the template's loop wrote pages each child then
 * kept, and the namespace's first process wrote pages its fork, the agent, then kept once it had
 * exec'd. The loop's CPU is paid per child too.
 *
 * Returns, in an agent, its index counted from 1; in the template 0 once all n are forked, or
 * -errno of the call that failed (pids[i] is 0 for each child not made).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <unistd.h>

typedef void (*hook)(void);

/* The first process of the new namespace: fork the agent, exec forkd-init as PID 1 (never returns
 * here but in the agent). Only async-signal-safe calls: we are a fork of a process with threads. */
static int first_process(const char *init, hook after_child, int index) {
    pid_t agent = fork();
    if (agent == 0) {
        after_child();
        return index;
    }
    if (agent > 0) {
        char number[16], *p = number + sizeof number;
        *--p = 0;
        do
            *--p = (char)('0' + agent % 10);
        while ((agent /= 10) > 0);
        char *argv[] = {(char *)init, p, NULL};
        execv(init, argv);
    }
    _exit(127);   /* no init: our exit ends the namespace, and the agent with it, loudly */
}

int forkd_fanout(int n, int pidns_fd, int *pids, const char *init, hook before, hook after_parent,
                 hook after_child) {
    if (access(init, X_OK) != 0)
        return -errno;
    int err = 0;
    before();
    for (int i = 0; i < n && !err; i++) {
        if (unshare(CLONE_NEWPID) != 0) {
            err = errno;
            break;
        }
        pid_t pid = fork();
        if (pid == 0)
            return first_process(init, after_child, i + 1);
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
