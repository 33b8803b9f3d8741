/* forkd-init: PID 1 of a process sandbox's (or snapshot template's) pid namespace.
 *
 * A pid namespace dies with its PID 1, and every branch or child forked from the sandbox is
 * nested in that namespace. So the sandbox's Python (the agent) is never PID 1: it is this
 * program's child, and whatever ends it (a kill -9, the OOM killer, a segfault, os._exit) leaves
 * the namespace standing for as long as anything nested in it lives.
 *
 *   forkd-init AGENT_PID      exec'd by the namespace's first process right after it forked the agent
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
 * Kept tiny on purpose: its private memory is paid once per sandbox.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int proc_fd = -1;   /* our namespace's /proc, in our own mount namespace: no mount of the agent's can blind us */

/* Whether ``pid`` (a /proc entry) is a live process of our own pid namespace, not of one nested in
 * it and not a zombie: its NSpid line (its pid in each namespace from ours down to its own) has a
 * single number. /proc/N/status needs no ptrace access, which a fork of the agent denies us (its
 * memory belongs to the host's user namespace, where we hold no capability). */
static int is_stray(const char *pid) {
    char path[300], buf[4096];
    snprintf(path, sizeof path, "%s/status", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *state = strstr(buf, "\nState:\t"), *line = strstr(buf, "\nNSpid:");
    if (state == NULL || state[8] == 'Z' || line == NULL)
        return 0;
    int numbers = 0, in_number = 0;
    for (char *c = line + 7; *c && *c != '\n'; c++) {
        int digit = *c >= '0' && *c <= '9';
        numbers += digit && !in_number;
        in_number = digit;
    }
    return numbers == 1;
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

static void say_how(int status) {
    char name[16];
    if (WIFSIGNALED(status))
        snprintf(name, sizeof name, "forkd-init s%d", WTERMSIG(status));
    else
        snprintf(name, sizeof name, "forkd-init x%d", WEXITSTATUS(status));
    prctl(PR_SET_NAME, name, 0, 0, 0);
}

int main(int argc, char **argv) {
    if (argc != 2 || getpid() != 1) {
        fprintf(stderr, "usage: forkd-init AGENT_PID (as PID 1 of a pid namespace, by forkd's process engine)\n");
        return 2;
    }
    pid_t agent = (pid_t)atoi(argv[1]);
    /* Nothing of the agent's stays open here (its listening socket above all: a dead agent's must
     * refuse connections, not queue them). */
    if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0)
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
    signal(SIGCHLD, SIG_DFL);   /* an ignored SIGCHLD survives exec, and would reap for us */
    prctl(PR_SET_NAME, "forkd-init", 0, 0, 0);

    sigset_t all, wanted;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);   /* as PID 1 nothing inside may stop us; we wait for these two */
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGCHLD);
    sigaddset(&wanted, SIGTERM);

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
        siginfo_t info;
        if (sigwaitinfo(&wanted, &info) < 0)
            continue;
        /* si_pid is 0 for a sender outside our namespace (the engine, as root on the host). */
        if (info.si_signo == SIGTERM && info.si_code == SI_USER && (info.si_pid == 0 || info.si_pid == agent))
            collected = 1;
    }
}
