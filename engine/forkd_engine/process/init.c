/* forkd-init: PID 1 of a process sandbox's (or snapshot template's) pid namespace.
 *
 * A pid namespace dies with its PID 1, and every branch or child forked from the sandbox is
 * nested in that namespace. So the sandbox's Python (the agent) is never PID 1: it is this
 * program's child, and whatever ends it (a kill -9, the OOM killer, a segfault, os._exit) leaves
 * the namespace standing for as long as anything nested in it lives.
 *
 *   forkd-init AGENT_PID [GUARD_FD]   exec'd by the namespace's first process right after it forked the agent
 *
 * While the agent lives: reap what is orphaned in the namespace.
 * Once it has ended: say how in our command name ("forkd-init x3": exit status 3; "forkd-init
 * s9": killed by signal 9), where the engine reads it; kill every process left in our own pid
 * namespace (the user's commands; nested namespaces, the forks made for branches and children,
 * stay); reap until no child is left; exit once the engine has collected the status (SIGTERM from
 * outside the namespace, or from the agent itself when forkd retires it; the first process blocks
 * SIGTERM before it forks the agent, so one sent before we run waits for us). Until then we linger,
 * as a zombie does for its parent: a few pages of memory.
 *
 * The init of a snapshot's outermost namespace is also its tree's guard (GUARD_FD, below): it
 * answers the signal calls of every process forked from the snapshot.
 *
 * Kept tiny on purpose: its private memory is paid once per sandbox.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int proc_fd = -1;   /* our namespace's /proc, in our own mount namespace: no mount of the agent's can blind us */

/* /proc/N/status of ``pid`` (a /proc entry, "N" or "N/task/T") into buf; its length, or -1. It
 * needs no ptrace access, which a fork of the agent denies us (its memory belongs to the host's
 * user namespace, where we hold no capability). */
static ssize_t read_status(const char *pid, char *buf, size_t size) {
    char path[300];
    snprintf(path, sizeof path, "%s/status", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    return n;
}

/* The numbers of a status line (key: "\nNSpid:", "\nPPid:", "\nTgid:"): how many there are; the
 * first ``max`` into ``out``. NSpid is a process's pid in each namespace from ours down to its own. */
static int numbers(const char *status, const char *key, long *out, int max) {
    const char *c = strstr(status, key);
    if (c == NULL)
        return 0;
    int count = 0;
    for (c += strlen(key); *c && *c != '\n';) {
        if (*c < '0' || *c > '9') {
            c++;
            continue;
        }
        char *end;
        long value = strtol(c, &end, 10);
        if (count < max)
            out[count] = value;
        count++;
        c = end;
    }
    return count;
}

/* Whether ``pid`` is a live process of our own pid namespace, not of one nested in it and not a
 * zombie: its NSpid line has a single number. */
static int is_stray(const char *pid) {
    char buf[4096];
    long ns[1];
    if (read_status(pid, buf, sizeof buf) < 0)
        return 0;
    const char *state = strstr(buf, "\nState:\t");
    return state != NULL && state[8] != 'Z' && numbers(buf, "\nNSpid:", ns, 1) == 1;
}

/* A /proc of our own pid namespace, in a mount namespace of our own, made when first needed: we
 * were forked before the agent set up its namespaces, and a spawn should not wait for ours. */
static int open_own_proc(void) {
    if (proc_fd < 0 && (unshare(CLONE_NEWNS) != 0 ||
                        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0 ||
                        (proc_fd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0))
        perror("forkd-init: /proc");   /* we still hold the namespace and reap; strays can't be found */
    return proc_fd;
}

/* SIGKILL every live process of our own pid namespace but us; returns how many. Called again
 * after each reap while it finds any: a process forked meanwhile is found by the next pass. */
static int kill_strays(void) {
    if (open_own_proc() < 0)
        return 0;
    int fd = dup(proc_fd), found = 0;
    DIR *dir = fd < 0 ? NULL : fdopendir(fd);
    if (dir == NULL) {
        if (fd >= 0)
            close(fd);
        return 0;
    }
    rewinddir(dir);
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1)
            continue;
        if (is_stray(e->d_name) && kill((pid_t)pid, SIGKILL) == 0)
            found++;
    }
    closedir(dir);
    return found;
}

/* --- the guard ----------------------------------------------------------------------------------
 *
 * Every branch is a fork of its sandbox, so it lives in a pid namespace nested in the sandbox's,
 * with the same uid: by the kernel's own rule the sandbox could signal it, and so end a save point
 * and every sandbox spawned from it. A snapshot's template therefore installs its seccomp filter
 * (linux.py) with a listener, which it hands to this init, the PID 1 of the snapshot's outermost
 * namespace: nothing forked from the snapshot sees it. The filter sends here every call of the
 * snapshot's tree that signals a process named by number (kill and rt_sigqueueinfo of a pid > 0,
 * tgkill, rt_tgsigqueueinfo, tkill, fcntl F_SETOWN of a pid > 0); the guard lets it through when the
 * target is of the caller's own pid namespace, refuses it (EPERM) when the target is in a namespace
 * nested in it, and answers ESRCH for a pid that names nothing. Group signals need no look: every
 * namespace forkd makes starts a session of its own, so a group never spans two. */

#define MAX_DEPTH 40                 /* pid namespaces nest at most 32 deep */
#define MAX_QUEUE 65536

struct proc {
    long ns[MAX_DEPTH];              /* its pid in each namespace, from ours down to its own */
    int depth;                       /* how many namespaces */
    long ppid, tgid;                 /* in ours */
};

static int look(long pid, struct proc *p) {
    char name[24], buf[4096];
    snprintf(name, sizeof name, "%ld", pid);
    if (read_status(name, buf, sizeof buf) < 0)
        return -1;
    p->depth = numbers(buf, "\nNSpid:", p->ns, MAX_DEPTH);
    long one[1];
    p->ppid = numbers(buf, "\nPPid:", one, 1) == 1 ? one[0] : 0;
    p->tgid = numbers(buf, "\nTgid:", one, 1) == 1 ? one[0] : pid;
    return p->depth > 0 && p->depth <= MAX_DEPTH ? 0 : -1;
}

static long queue[MAX_QUEUE];        /* these two untouched until a guard needs them: no private memory elsewhere */
static char list[1 << 16];           /* a thread's children, as /proc says them ("12 34 ") */

/* The children of every thread of ``pid``, in our namespace, appended to queue[*end]. */
static void enqueue_children(long pid, int *end) {
    char path[64];
    snprintf(path, sizeof path, "%ld/task", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *tasks = fd < 0 ? NULL : fdopendir(fd);
    if (tasks == NULL) {
        if (fd >= 0)
            close(fd);
        return;
    }
    struct dirent *t;
    while ((t = readdir(tasks)) != NULL) {
        if (t->d_name[0] < '0' || t->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "%ld/task/%.20s/children", pid, t->d_name);
        int cfd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
        if (cfd < 0)
            continue;
        size_t size = 0;
        ssize_t n;
        while (size < sizeof list - 1 && (n = read(cfd, list + size, sizeof list - 1 - size)) > 0)
            size += (size_t)n;
        close(cfd);
        if (size == sizeof list - 1)   /* full: the last number may be cut */
            while (size > 0 && list[size - 1] != ' ')
                size--;
        list[size] = 0;
        for (char *c = list; *c && *end < MAX_QUEUE;) {
            char *next;
            long child = strtol(c, &next, 10);
            if (next == c)
                break;
            queue[(*end)++] = child;
            c = next;
        }
    }
    closedir(tasks);
}

/* 0 if the thread ``caller`` (its id in our namespace) may signal ``target`` (a pid as the caller
 * names it; with ``thread``, a thread id, tkill's), else -EPERM or -ESRCH. */
static int may_signal(long caller, long target, int thread) {
    static struct proc me, p;
    if (look(caller, &p) != 0 || (p.tgid != caller && look(p.tgid, &me) != 0))
        return -ESRCH;           /* the caller is gone; the answer reaches no one */
    if (p.tgid == caller)
        me = p;                  /* the calling thread is its process's main thread */
    int level = me.depth - 1;    /* the caller's namespace, as an index into ns[] */
    if (target == me.ns[level] || target == p.ns[level])
        return 0;                /* itself, or the calling thread */
    if (thread)
        return -EPERM;           /* tkill: another process's threads are tgkill's */
    if (target == 1)
        return 0;                /* its namespace's init */
    /* Every process of the caller's namespace, and of those nested in it, descends from its init:
     * up the parents from the caller to the process that is pid 1 at its level. */
    long init = me.tgid;
    p = me;
    for (int hops = 0; p.ns[level] != 1; hops++) {
        init = p.ppid;
        if (hops > MAX_QUEUE || look(init, &p) != 0 || p.depth != me.depth)
            return -EPERM;
    }
    int head = 0, end = 0;
    queue[end++] = init;
    while (head < end) {
        int from = end;
        enqueue_children(queue[head++], &end);
        for (int i = from; i < end; i++)
            if (look(queue[i], &p) == 0 && p.depth > level && p.ns[level] == target)
                return p.depth == me.depth ? 0 : -EPERM;
    }
    return -ESRCH;
}

static void guard_answer(int listener) {
    struct seccomp_notif req;
    struct seccomp_notif_resp resp;
    memset(&req, 0, sizeof req);
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &req) != 0)
        return;                  /* the caller died meanwhile */
    int nr = req.data.nr;
    long target = (int)(nr == SYS_fcntl ? req.data.args[2] : req.data.args[0]);
    int verdict = may_signal(req.pid, target, nr == SYS_tkill);
    memset(&resp, 0, sizeof resp);
    resp.id = req.id;
    if (verdict == 0)
        resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    else
        resp.error = verdict;
    ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

/* The listener, as the template sends it on the guard's socket; -1 if it closed without one. */
static int receive_listener(int sock) {
    char byte;
    union {
        struct cmsghdr header;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.space,
                         .msg_controllen = sizeof control.space};
    int fd = -1;
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) > 0) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (c != NULL && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            memcpy(&fd, CMSG_DATA(c), sizeof fd);
    }
    close(sock);
    return fd;
}

static void say_how(int status) {
    char name[16];
    if (WIFSIGNALED(status))
        snprintf(name, sizeof name, "forkd-init s%d", WTERMSIG(status));
    else
        snprintf(name, sizeof name, "forkd-init x%d", WEXITSTATUS(status));
    prctl(PR_SET_NAME, name, 0, 0, 0);
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3 || getpid() != 1) {
        fprintf(stderr, "usage: forkd-init AGENT_PID [GUARD_FD] (as PID 1 of a pid namespace, by forkd's process engine)\n");
        return 2;
    }
    pid_t agent = (pid_t)atoi(argv[1]);
    /* Nothing of the agent's stays open here (its listening socket above all: a dead agent's must
     * refuse connections, not queue them), but the socket the guard's listener comes on. */
    int guard = -1;
    if (argc == 3 && dup2(atoi(argv[2]), 3) == 3)
        guard = 3;
    if (syscall(SYS_close_range, guard < 0 ? 3U : 4U, ~0U, 0U) != 0)
        for (int fd = guard < 0 ? 3 : 4; fd < 1024; fd++)
            close(fd);
    signal(SIGCHLD, SIG_DFL);   /* an ignored SIGCHLD survives exec, and would reap for us */
    prctl(PR_SET_NAME, "forkd-init", 0, 0, 0);

    sigset_t all, wanted;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);   /* as PID 1 nothing inside may stop us; we wait for these two */
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGCHLD);
    sigaddset(&wanted, SIGTERM);
    int signals = signalfd(-1, &wanted, SFD_CLOEXEC);
    if (signals < 0) {
        perror("forkd-init: signalfd");
        return 1;
    }
    if (guard >= 0)
        open_own_proc();
    int listening = 0;   /* whether ``guard`` is the listener yet, or still the socket it comes on */

    int agent_done = 0, collected = 0, strays = 0;
    for (;;) {
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (pid == agent && !agent_done) {
                agent_done = 1;
                say_how(status);
                strays = 1;
            }
        }
        if (strays)
            strays = kill_strays() > 0;   /* each killed one wakes us as it is reaped */
        if (pid < 0 && errno == ECHILD && agent_done && collected)
            return 0;
        struct pollfd ready[2] = {{signals, POLLIN, 0}, {guard, POLLIN, 0}};
        if (poll(ready, guard >= 0 ? 2 : 1, -1) < 0)
            continue;
        if (ready[1].revents & POLLIN) {
            if (listening)
                guard_answer(guard);
            else
                listening = (guard = receive_listener(guard)) >= 0;
        } else if (ready[1].revents & (POLLHUP | POLLERR | POLLNVAL)) {
            close(guard);   /* no process of the tree is left to ask */
            guard = -1;
        }
        struct signalfd_siginfo info;
        if (!(ready[0].revents & POLLIN) || read(signals, &info, sizeof info) != sizeof info)
            continue;
        /* ssi_pid is 0 for a sender outside our namespace (the engine, as root on the host). */
        if (info.ssi_signo == SIGTERM && info.ssi_code == SI_USER && (info.ssi_pid == 0 || info.ssi_pid == (uint32_t)agent))
            collected = 1;
    }
}
