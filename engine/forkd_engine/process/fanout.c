/* forkd's fan-out loop: a template's fork of a spawn's children, in C.
 *
 *   int forkd_fanout(int n, int pidns_fd, int *pids, const char *init, const struct setup *setup,
 *                    before, after_parent, after_child)
 *
 * Each child is the first process (PID 1) of a pid namespace of its own: unshare(CLONE_NEWPID),
 * then setns() back to ours (pidns_fd) for the next one. That first process must become forkd-init
 * (``init``) with the sandbox's agent, a copy of the template, as its child. It is made with
 * clone(CLONE_VM | CLONE_VFORK): it runs on a small stack of its own in the template's memory
 * while the template waits, forks the agent from that memory (the one copy of the template's page
 * tables a child costs), and execs forkd-init, which hands the memory back to the template whole
 * (no second copy to make and tear down, as forking the agent from a forked copy would). The agent
 * goes on where the template stood before the clone (longjmp), as a fork child of it would. Loaded
 * into the template with ctypes.PyDLL (the GIL stays held, as os.fork holds it), and given
 * CPython's own fork hooks (PyOS_BeforeFork, PyOS_AfterFork_Parent, PyOS_AfterFork_Child): the
 * interpreter sees one fork per agent exactly as os.fork() makes it, each agent running its
 * after-fork hooks first thing.
 *
 * Why in C: Python between two forks writes the interpreter's memory (reference counts, frames,
 * ctypes arguments, after-fork hooks), and every page written in a process whose copy another
 * then holds alone is private memory of that copy: the template's loop wrote pages each child then
 * kept, and the namespace's first process wrote pages its fork, the agent, then kept once it had
 * exec'd. The loop's CPU is paid per child too.
 *
 * With ``setup`` (not NULL), each agent also sets itself up here, before Python resumes: it closes
 * the template's agent descriptors but its own two, takes its own mount, UTS, IPC (and network)
 * namespaces, mounts its /proc, sets its hostname, brings its lo up and lays its own machine id
 * over /etc/machine-id (machine_id.py). Done in Python, each step ran code and touched objects all
 * over the template's heap, and each page touched (a reference count written) became the agent's
 * own copy; here it is a few system calls. forkd_fanout_error() then says, in the agent, which
 * step failed (NULL when none did), for the agent to report.
 *
 * With ``setup->ready_lines`` too, each agent then stays in C while it idles: it sends its ready
 * report, and answers pings (the line of ``ping_formats``, its pid and uptime filled in) on the
 * connections it accepts, until a connection asks anything else, a connection cannot be read as a
 * whole ping, or a signal arrives. Only then does Python resume in it (CPython's after-fork hooks
 * run then): forkd_fanout_handover() gives it the connections to serve on (the request that ended
 * the idling still unread in its connection) and when it was forked. An idle sandbox thus writes
 * none of the template's Python heap: its private memory is what the kernel and this loop wrote,
 * and a spawn's children cost no Python until they are first used.
 *
 * Returns, in an agent, its index counted from 1; in the template 0 once all n are forked, or
 * -errno of the call that failed (pids[i] is 0 for each child not made).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/random.h>
#include <sys/rseq.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*hook)(void);

/* What each agent sets up before Python resumes (see above); the same layout as fanout.py's. */
struct setup {
    int ns_flags;                 /* for unshare: CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC (| CLONE_NEWNET) */
    const int *close_fds;         /* the template's agent descriptors ... */
    int n_close;
    int report_fd;                /* ... but the spawn's report socket */
    const int *listen_fds;        /* and the agent's own listener, by index */
    const char *const *hostnames; /* by index, each at most 64 bytes */
    const char *const *ready_lines;  /* by index, the ready report; NULL: report from Python, no idling */
    const char *const *ping_formats; /* by index, the ping's reply line as a printf format of (pid, uptime) */
};

static char setup_error[160];
static const char *setup_failed;  /* NULL, or setup_error: what the agent's set-up could not do */

static int failed(const char *what) {
    snprintf(setup_error, sizeof setup_error, "%s: %s", what, strerror(errno));
    setup_failed = setup_error;
    return -1;
}

/* A new network namespace starts with lo down. */
static int loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    struct ifreq req;
    memset(&req, 0, sizeof req);
    strcpy(req.ifr_name, "lo");
    int ret = ioctl(s, SIOCGIFFLAGS, &req);
    if (ret == 0) {
        req.ifr_flags |= IFF_UP;
        ret = ioctl(s, SIOCSIFFLAGS, &req);
    }
    int saved = errno;
    close(s);
    errno = saved;
    return ret;
}

/* machine_id.py's own_machine_id(), for a spawn's agent: a new id (a random UUID's 32 hex digits,
 * as uuid.uuid4().hex) in a file on a small read-only tmpfs at /run, bound over /etc/machine-id;
 * nothing where the host has no /etc/machine-id file. */
static int own_machine_id(void) {
    struct stat st;
    if (stat("/etc/machine-id", &st) != 0 || !S_ISREG(st.st_mode))
        return 0;
    unsigned char raw[16];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
        return failed("machine id: getrandom");
    raw[6] = (raw[6] & 0x0f) | 0x40;   /* version 4 */
    raw[8] = (raw[8] & 0x3f) | 0x80;   /* RFC 4122 variant */
    char id[33];
    for (int k = 0; k < 16; k++) {
        id[2 * k] = "0123456789abcdef"[raw[k] >> 4];
        id[2 * k + 1] = "0123456789abcdef"[raw[k] & 15];
    }
    id[32] = '\n';
    unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    if (mount("forkd-run", "/run", "tmpfs", flags, "size=4k,mode=755") != 0)
        return failed("machine id: mount tmpfs on /run");
    int fd = open("/run/machine-id", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0)
        return failed("machine id: /run/machine-id");
    int ok = write(fd, id, sizeof id) == (ssize_t)sizeof id && fchmod(fd, 0444) == 0;
    int saved = errno;
    close(fd);
    errno = saved;
    if (!ok)
        return failed("machine id: writing /run/machine-id");
    if (mount(NULL, "/run", NULL, MS_REMOUNT | MS_RDONLY | flags, NULL) != 0)
        return failed("machine id: remount /run read-only");
    if (mount("/run/machine-id", "/etc/machine-id", NULL, MS_BIND, NULL) != 0)
        return failed("machine id: bind over /etc/machine-id");
    return 0;
}

static int set_up_agent(const struct setup *s, int i) {
    for (int k = 0; k < s->n_close; k++)
        if (s->close_fds[k] != s->report_fd && s->close_fds[k] != s->listen_fds[i])
            close(s->close_fds[k]);
    if (unshare(s->ns_flags) != 0)
        return failed("unshare");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        return failed("mount proc on /proc");
    if (sethostname(s->hostnames[i], strnlen(s->hostnames[i], 64)) != 0)
        return failed("sethostname");
    if ((s->ns_flags & CLONE_NEWNET) && loopback_up() != 0)
        return failed("bringing lo up");
    return own_machine_id();
}

const char *forkd_fanout_error(void) {
    return setup_failed;
}

/* --- an agent idling in C until its first request that is not a ping --- */

#define IDLE_CONNS 64
static const char PING[] = "{\"action\":\"ping\"}", PING_SPACED[] = "{\"action\": \"ping\"}";

static int idled;                       /* this agent reported ready and idled here */
static double forked_at;                /* when (CLOCK_REALTIME, as Python's time.time()) */
static int conns[IDLE_CONNS], n_conns;  /* the connections it accepted, for Python to serve on */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* One readable connection: 0 when a ping was answered (or nothing is there yet), -1 when the
 * connection ended (closed here), 1 when Python must read what it sends. */
static int answer(int conn, const char *format) {
    char line[sizeof PING_SPACED], reply[4096];
    if (strlen(format) + 40 > sizeof reply)
        return 1;   /* a lineage too long to answer here: Python does */
    ssize_t got = recv(conn, line, sizeof line, MSG_PEEK | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    if (got <= 0) {   /* the client closed (forkd's clients half-close after a request) or failed */
        close(conn);
        return -1;
    }
    size_t len;
    if (got >= (ssize_t)sizeof PING && memcmp(line, PING, sizeof PING - 1) == 0 && line[sizeof PING - 1] == '\n')
        len = sizeof PING;   /* the line and its newline */
    else if (got >= (ssize_t)sizeof PING_SPACED && memcmp(line, PING_SPACED, sizeof PING_SPACED - 1) == 0
             && line[sizeof PING_SPACED - 1] == '\n')
        len = sizeof PING_SPACED;
    else
        return 1;   /* another request, or one not all here yet: Python reads it */
    char fds[CMSG_SPACE(253 * sizeof(int))];
    struct iovec io = {line, len};
    struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = fds, .msg_controllen = sizeof fds};
    if (recvmsg(conn, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) != (ssize_t)len)
        return 1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))   /* a ping takes none */
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (int *fd = (int *)CMSG_DATA(c); (char *)(fd + 1) <= (char *)c + c->cmsg_len; fd++)
                close(*fd);
    int n = snprintf(reply, sizeof reply, format, (int)getpid(), now() - forked_at);
    if (n <= 0 || n >= (int)sizeof reply || send(conn, reply, n, MSG_DONTWAIT | MSG_NOSIGNAL) != n) {
        close(conn);   /* gone, or a full buffer: the client sees no answer, as if it had closed */
        return -1;
    }
    char more;
    if (recv(conn, &more, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {   /* it half-closed after its ping (forkd's clients do) */
        close(conn);
        return -1;
    }
    return 0;
}

/* Report ready, then serve pings until Python is needed (see the top of this file). */
static void idle(const struct setup *s, int i) {
    const char *ready = s->ready_lines[i];
    if (send(s->report_fd, ready, strlen(ready), MSG_NOSIGNAL) < 0) {
        /* The engine is gone and never learnt of us, so no one will ask our init how we ended. */
        kill(1, SIGTERM);
        _exit(1);
    }
    close(s->report_fd);
    idled = 1;
    int listener = s->listen_fds[i];
    struct pollfd wait[1 + IDLE_CONNS];
    for (;;) {
        wait[0] = (struct pollfd){.fd = listener, .events = POLLIN};
        for (int k = 0; k < n_conns; k++)
            wait[1 + k] = (struct pollfd){.fd = conns[k], .events = POLLIN};
        if (poll(wait, 1 + n_conns, -1) < 0)
            return;   /* a signal (EINTR): Python runs its handlers */
        if (wait[0].revents & (POLLERR | POLLNVAL))
            return;
        int more = 0;
        for (int k = n_conns - 1; k >= 0; k--) {
            if (!wait[1 + k].revents)
                continue;
            int verdict = answer(conns[k], s->ping_formats[i]);
            if (verdict < 0)
                conns[k] = conns[--n_conns];
            more |= verdict > 0;
        }
        if (more)
            return;
        if (wait[0].revents & POLLIN) {
            int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0)
                conns[n_conns++] = conn;
            if (n_conns == IDLE_CONNS)
                return;
        }
    }
}

/* In an agent: -1 when it did not idle here (it reports ready itself); else how many connections
 * it hands over (their descriptors in fds, at most max) and, in at, when it was forked. */
int forkd_fanout_handover(int *fds, int max, double *at) {
    if (!idled)
        return -1;
    for (int k = 0; k < n_conns && k < max; k++)
        fds[k] = conns[k];
    *at = forked_at;
    return n_conns;
}

static sigjmp_buf resume;  /* the template in its loop, where each agent goes on */
static char first_stack[64 * 1024] __attribute__((aligned(16)));

struct first {
    const char *init;
    int index;
};

/* The first process of the new namespace, in the template's memory while the template waits:
 * fork the agent (glibc's fork, whose child side resets what the C library kept of the template's
 * threads and locks), then exec forkd-init as PID 1 (never returns). Signals are blocked
 * throughout, so no handler of the template's runs here on its memory. */
static int first_process(void *arg) {
    struct first *f = arg;
    setsid();   /* a session and process group of its own: no group signal of the template's or a sibling's reaches it */
    pid_t agent = fork();
    if (agent == 0)
        siglongjmp(resume, f->index);
    if (agent > 0) {
        char number[16], *p = number + sizeof number;
        *--p = 0;
        do
            *--p = (char)('0' + agent % 10);
        while ((agent /= 10) > 0);
        char *argv[] = {(char *)f->init, p, NULL};
        execv(f->init, argv);
    }
    _exit(127);   /* no init: our exit ends the namespace, and the agent with it, loudly */
}

int forkd_fanout(int n, int pidns_fd, int *pids, const char *init, const struct setup *setup, hook before,
                 hook after_parent, hook after_child) {
    if (access(init, X_OK) != 0)
        return -errno;
    int err = 0;
    sigset_t all, old;
    sigfillset(&all);
    before();
    sigprocmask(SIG_SETMASK, &all, &old);
    for (int i = 0; i < n && !err; i++) {
        if (unshare(CLONE_NEWPID) != 0) {
            err = errno;
            break;
        }
        struct first f = {init, i + 1};
        int index = sigsetjmp(resume, 0);
        if (index > 0) {   /* the agent */
            setpgid(0, 0);  /* a group of its own, apart from its init's (pgid 1 cannot be signalled: -1 means all) */
            /* A fork inherits its parent's rseq area, and the first process, made with CLONE_VM,
             * had none: register the one glibc set up for this thread again (sched_getcpu). */
            if (__rseq_size > 0)
                syscall(SYS_rseq, (char *)__builtin_thread_pointer() + __rseq_offset,
                        __rseq_size < 32 ? 32 : __rseq_size, 0, RSEQ_SIG);   /* 32: the original ABI's */
            idled = n_conns = 0;   /* a grandchild's copy of what its template's source left here */
            setup_failed = NULL;
            forked_at = now();
            if (setup != NULL && set_up_agent(setup, index - 1) == 0 && setup->ready_lines != NULL) {
                /* A SIGINT interrupts what runs, and nothing does: it is dropped, as a sandbox's
                 * executor ignores one between cells. Any other signal ends the idling. */
                sigset_t intr, idling = old;
                sigemptyset(&intr);
                sigaddset(&intr, SIGINT);
                sigaddset(&idling, SIGINT);
                sigprocmask(SIG_SETMASK, &idling, NULL);
                idle(setup, index - 1);
                while (sigtimedwait(&intr, NULL, &(struct timespec){0, 0}) == SIGINT)
                    ;
            }
            sigprocmask(SIG_SETMASK, &old, NULL);
            after_child();
            return index;
        }
        pid_t pid = clone(first_process, first_stack + sizeof first_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &f);
        if (pid < 0)
            err = errno;
        else
            pids[i] = pid;
        if (setns(pidns_fd, CLONE_NEWPID) != 0 && !err)   /* our own namespace again, for the next */
            err = errno;
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    after_parent();
    return -err;
}
