/*
 * loadgen: an MLLP load generator that is not the bottleneck.
 *
 * One thread per connection; each connection sends serially: one framed
 * message, wait for its ACK, the next one. That is how a hospital sender
 * behaves in original mode (HL7 v2 MLLP, one outstanding message per
 * connection), so throughput here is bounded by the receiver's ACK latency,
 * not by pipelining.
 *
 * Every message gets a unique MSH-10 "<prefix>.<connection>.<n>", so a
 * receiver that deduplicates on MSH-10 never sees a retransmit, and a bench
 * can reconstruct exactly which control ids were ACKed from the per-connection
 * counts in the report. With --reconnect a connection that fails reconnects
 * and resends the unACKed message with the same MSH-10 (a retransmit, as a
 * real sender would do it).
 *
 * Output: one JSON object on stdout (msg/s, ACK latency percentiles, counts
 * per MSA-1 code, errors, reconnects, per-connection counts, own CPU time).
 * Built on demand by bench/harness.py with the system compiler.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAX_PORTS 64
#define MAX_CODES 16
#define RECV_BUF (256 * 1024)

/* ~230 bytes (with a 14-character MSH-10): an ADT^A01 with the fields a real feed carries. */
static const char BUILTIN_ADT[] =
    "MSH|^~\\&|LOADGEN|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|X|P|2.5.1\r"
    "EVN|A01|20260101120000\r"
    "PID|1||123456^^^MRN^MR||DOE^JANE^Q||19800101|F|||1 MAIN ST^^SPRINGFIELD^IL^62701\r"
    "PV1|1|I|WARD^101^1||||1234^SMITH^JOHN\r";

enum err_kind { E_CONNECT, E_CLOSED, E_TIMEOUT, E_SEND, E_RECV, E_FRAME, E_KINDS };
static const char *ERR_NAMES[E_KINDS] = {"connect", "closed", "timeout", "send", "recv", "frame"};

struct options {
    const char *host;
    int ports[MAX_PORTS];
    int nports;
    int connections;
    double duration;      /* seconds of measurement (0: use count) */
    long count;           /* messages to measure in total (0: use duration) */
    double warmup;        /* seconds sent before measuring */
    double timeout;       /* seconds to wait for one ACK */
    int reconnect;
    int patients;         /* 0: PID-3.1 as in the template; K: one of K patients per message */
    const char *prefix;
    const char *template_path;
};

/* The template, split around MSH-10 and (optionally) PID-3.1. */
static char *tpl_a, *tpl_b, *tpl_c; /* a [MSH-10] b [PID-3.1] c  (c NULL: no PID slot) */
static size_t tpl_a_len, tpl_b_len, tpl_c_len;

static struct options opt;
static struct timespec t_zero;
static double t_start, t_measure, t_end_send; /* seconds since t_zero */
static atomic_long remaining;                   /* count mode */
static atomic_int ready_threads;
static atomic_int go;
static atomic_long frame_bytes; /* payload size of the last message built (without MLLP framing) */

struct conn_stats {
    int index;
    int port;
    long sent_ids;       /* control ids used: 0 .. sent_ids-1 */
    long acked;          /* ACKs received (all codes) */
    long measured;       /* ACKs of messages sent inside the measurement window */
    int unacked;         /* 1 when the run ended with a message sent but not ACKed */
    long errors[E_KINDS];
    long reconnects;
    long mismatched;     /* ACKs whose MSA-2 is not the sent MSH-10 */
    char codes[MAX_CODES][8];
    long code_counts[MAX_CODES];
    int ncodes;
    uint32_t *lat_us;    /* latencies of measured messages */
    long nlat, caplat;
    double last_ack;     /* time of the last measured ACK */
    int alive;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)(ts.tv_sec - t_zero.tv_sec) + (double)(ts.tv_nsec - t_zero.tv_nsec) / 1e9;
}

static double mono_abs(double rel) {
    return (double)t_zero.tv_sec + (double)t_zero.tv_nsec / 1e9 + rel;
}

static void die(const char *msg) {
    fprintf(stderr, "loadgen: %s\n", msg);
    exit(2);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "loadgen: cannot open template %s: %s\n", path, strerror(errno));
        exit(2);
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

/* Normalise segment ends to \r (HL7 v2 segment terminator) and drop blank lines. */
static char *normalise(const char *src, size_t len, size_t *out_len) {
    char *dst = malloc(len + 2);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        char ch = src[i];
        if (ch == '\n' || ch == '\r') {
            if (ch == '\r' && i + 1 < len && src[i + 1] == '\n')
                i++;
            if (n > 0 && dst[n - 1] != '\r')
                dst[n++] = '\r';
            continue;
        }
        dst[n++] = ch;
    }
    if (n > 0 && dst[n - 1] != '\r')
        dst[n++] = '\r';
    *out_len = n;
    return dst;
}

/* Position [start, end) of field `field` (MSH-1 is the separator itself, so MSH-n is split index n-1). */
static int find_field(const char *seg, size_t seglen, char sep, int split_index, size_t *start, size_t *end) {
    int idx = 0;
    size_t i = 0, fstart = 0;
    for (i = 0; i <= seglen; i++) {
        if (i == seglen || seg[i] == sep || seg[i] == '\r') {
            if (idx == split_index) {
                *start = fstart;
                *end = i;
                return 1;
            }
            if (i == seglen || seg[i] == '\r')
                return 0;
            idx++;
            fstart = i + 1;
        }
    }
    return 0;
}

static void prepare_template(void) {
    size_t raw_len;
    char *raw;
    if (opt.template_path) {
        raw = read_file(opt.template_path, &raw_len);
    } else {
        raw_len = sizeof(BUILTIN_ADT) - 1;
        raw = malloc(raw_len);
        memcpy(raw, BUILTIN_ADT, raw_len);
    }
    size_t len;
    char *msg = normalise(raw, raw_len, &len);
    free(raw);
    if (len < 8 || memcmp(msg, "MSH", 3) != 0)
        die("the template must start with an MSH segment");
    char sep = msg[3];
    char comp = msg[4];
    size_t s10, e10;
    /* split index 9 = MSH-10: "MSH", MSH-2, MSH-3 ... */
    if (!find_field(msg, len, sep, 9, &s10, &e10))
        die("the template's MSH has no MSH-10 field");
    size_t pid_s = 0, pid_e = 0;
    int have_pid = 0;
    if (opt.patients > 0) {
        for (size_t i = 0; i + 4 < len; i++) {
            if ((i == 0 || msg[i - 1] == '\r') && memcmp(msg + i, "PID", 3) == 0 && msg[i + 3] == sep) {
                size_t fs, fe;
                if (find_field(msg + i, len - i, sep, 3, &fs, &fe)) {
                    pid_s = i + fs;
                    pid_e = pid_s;
                    while (pid_e < i + fe && msg[pid_e] != comp)
                        pid_e++;
                    have_pid = 1;
                }
                break;
            }
        }
        if (!have_pid)
            die("--patients needs a PID segment with a PID-3 field in the template");
    }
    tpl_a = msg;
    tpl_a_len = s10;
    tpl_b = msg + e10;
    if (have_pid) {
        tpl_b_len = pid_s - e10;
        tpl_c = msg + pid_e;
        tpl_c_len = len - pid_e;
    } else {
        tpl_b_len = len - e10;
        tpl_c = NULL;
        tpl_c_len = 0;
    }
}

/* Frame: VT message FS CR (HL7 v2 MLLP, Appendix C of the transport specification). */
static size_t build_frame(char *buf, size_t cap, const char *cid, size_t cid_len, long patient) {
    char pid[32];
    int pid_len = 0;
    if (tpl_c)
        pid_len = snprintf(pid, sizeof pid, "P%ld", patient);
    size_t need = 3 + tpl_a_len + cid_len + tpl_b_len + (size_t)pid_len + tpl_c_len;
    if (need > cap)
        die("message too large for the send buffer");
    size_t n = 0;
    buf[n++] = 0x0b;
    memcpy(buf + n, tpl_a, tpl_a_len), n += tpl_a_len;
    memcpy(buf + n, cid, cid_len), n += cid_len;
    memcpy(buf + n, tpl_b, tpl_b_len), n += tpl_b_len;
    if (tpl_c) {
        memcpy(buf + n, pid, (size_t)pid_len), n += (size_t)pid_len;
        memcpy(buf + n, tpl_c, tpl_c_len), n += tpl_c_len;
    }
    buf[n++] = 0x1c;
    buf[n++] = 0x0d;
    return n;
}

static int open_conn(int port) {
    struct addrinfo hints = {0}, *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(opt.host, portstr, &hints, &res) != 0 || !res)
        return -1;
    int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
    if (fd < 0) {
        freeaddrinfo(res);
        return -1;
    }
    if (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
        close(fd);
        freeaddrinfo(res);
        return -1;
    }
    freeaddrinfo(res);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv;
    tv.tv_sec = (time_t)opt.timeout;
    tv.tv_usec = (suseconds_t)((opt.timeout - (double)tv.tv_sec) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return fd;
}

static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t w = send(fd, buf, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        len -= (size_t)w;
    }
    return 0;
}

static void count_code(struct conn_stats *st, const char *code, size_t len) {
    if (len > 7)
        len = 7;
    for (int i = 0; i < st->ncodes; i++) {
        if (strlen(st->codes[i]) == len && memcmp(st->codes[i], code, len) == 0) {
            st->code_counts[i]++;
            return;
        }
    }
    if (st->ncodes < MAX_CODES) {
        memcpy(st->codes[st->ncodes], code, len);
        st->codes[st->ncodes][len] = 0;
        st->code_counts[st->ncodes++] = 1;
    }
}

/* Read MSA-1 (the HL7 table 0008 acknowledgment code) and compare MSA-2 with our MSH-10. */
static void parse_ack(struct conn_stats *st, const char *ack, size_t len, const char *cid, size_t cid_len) {
    for (size_t i = 0; i + 4 <= len; i++) {
        if ((i == 0 || ack[i - 1] == '\r' || ack[i - 1] == '\n') && memcmp(ack + i, "MSA", 3) == 0) {
            char sep = ack[i + 3];
            size_t p = i + 4, q = p;
            while (q < len && ack[q] != sep && ack[q] != '\r' && ack[q] != '\n')
                q++;
            count_code(st, ack + p, q - p);
            size_t r = q < len && ack[q] == sep ? q + 1 : q, s = r;
            while (s < len && ack[s] != sep && ack[s] != '\r' && ack[s] != '\n')
                s++;
            if (s - r != cid_len || memcmp(ack + r, cid, cid_len) != 0)
                st->mismatched++;
            return;
        }
    }
    count_code(st, "none", 4);
}

/* Wait for one ACK frame. Returns 0 and the payload span, or an error kind. */
static int read_ack(int fd, char *buf, size_t *have, size_t *fstart, size_t *fend) {
    for (;;) {
        /* look for VT ... FS CR in what we have */
        char *vt = memchr(buf, 0x0b, *have);
        if (vt) {
            size_t s = (size_t)(vt - buf) + 1;
            for (size_t i = s; i + 1 < *have; i++) {
                if (buf[i] == 0x1c && buf[i + 1] == 0x0d) {
                    *fstart = s;
                    *fend = i;
                    return -1;
                }
            }
        } else {
            *have = 0; /* bytes outside a frame: skip them */
        }
        if (*have == RECV_BUF)
            return E_FRAME;
        ssize_t r = recv(fd, buf + *have, RECV_BUF - *have, 0);
        if (r == 0)
            return E_CLOSED;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return E_TIMEOUT;
            if (errno == ECONNRESET || errno == EPIPE)
                return E_CLOSED;
            return E_RECV;
        }
        *have += (size_t)r;
    }
}

static void add_latency(struct conn_stats *st, double seconds) {
    if (st->nlat == st->caplat) {
        st->caplat = st->caplat ? st->caplat * 2 : 65536;
        st->lat_us = realloc(st->lat_us, (size_t)st->caplat * sizeof(uint32_t));
        if (!st->lat_us)
            die("out of memory");
    }
    double us = seconds * 1e6;
    st->lat_us[st->nlat++] = us > 4e9 ? 4000000000u : (uint32_t)us;
}

static int reconnect_conn(struct conn_stats *st, int *fd) {
    double give_up = opt.duration > 0 ? t_end_send + opt.timeout : now_s() + opt.timeout;
    double backoff = 0.01;
    while (now_s() < give_up) {
        *fd = open_conn(st->port);
        if (*fd >= 0) {
            if (st->alive)
                st->reconnects++; /* the first connection of a thread is not a reconnect */
            return 0;
        }
        st->errors[E_CONNECT]++;
        struct timespec ts = {0, (long)(backoff * 1e9)};
        nanosleep(&ts, NULL);
        if (backoff < 0.2)
            backoff *= 2;
    }
    return -1;
}

static void *conn_thread(void *arg) {
    struct conn_stats *st = arg;
    char *rbuf = malloc(RECV_BUF);
    char *sbuf = malloc(64 * 1024);
    size_t have = 0;
    int fd = open_conn(st->port);
    if (fd < 0)
        st->errors[E_CONNECT]++;
    atomic_fetch_add(&ready_threads, 1);
    while (!atomic_load(&go)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (fd < 0 && (!opt.reconnect || reconnect_conn(st, &fd) != 0)) {
        free(rbuf);
        free(sbuf);
        return NULL;
    }
    st->alive = 1;
    char cid[64];
    for (;;) {
        double t_send = now_s();
        int measured = t_send >= t_measure;
        if (opt.duration > 0) {
            if (t_send >= t_end_send)
                break;
        } else if (measured) {
            if (atomic_fetch_sub(&remaining, 1) <= 0)
                break;
        }
        int cid_len = snprintf(cid, sizeof cid, "%s.%d.%ld", opt.prefix, st->index, st->sent_ids);
        long patient = opt.patients > 0 ? (long)(((uint64_t)st->index * 1000003u + (uint64_t)st->sent_ids) % (uint64_t)opt.patients) : 0;
        size_t flen = build_frame(sbuf, 64 * 1024, cid, (size_t)cid_len, patient);
        atomic_store(&frame_bytes, (long)flen - 3);
        st->sent_ids++;
        st->unacked = 1;
        int done = 0;
        while (!done) {
            int kind;
            size_t fs = 0, fe = 0;
            if (send_all(fd, sbuf, flen) != 0) {
                kind = E_SEND;
            } else {
                kind = read_ack(fd, rbuf, &have, &fs, &fe);
            }
            if (kind < 0) {
                double t_ack = now_s();
                parse_ack(st, rbuf + fs, fe - fs, cid, (size_t)cid_len);
                /* keep whatever followed the frame */
                size_t rest = have - (fe + 2);
                memmove(rbuf, rbuf + fe + 2, rest);
                have = rest;
                st->acked++;
                st->unacked = 0;
                if (measured) {
                    st->measured++;
                    add_latency(st, t_ack - t_send);
                    st->last_ack = t_ack;
                }
                done = 1;
                continue;
            }
            st->errors[kind]++;
            close(fd);
            fd = -1;
            have = 0;
            if (!opt.reconnect || reconnect_conn(st, &fd) != 0) {
                st->alive = 0;
                free(rbuf);
                free(sbuf);
                return NULL;
            }
            /* resend the same message, same MSH-10: a retransmit */
        }
    }
    if (fd >= 0)
        close(fd);
    free(rbuf);
    free(sbuf);
    return NULL;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static double pct(const uint32_t *v, long n, double p) {
    if (n == 0)
        return 0;
    long idx = (long)((double)n * p + 0.999999) - 1; /* nearest rank */
    if (idx < 0)
        idx = 0;
    if (idx >= n)
        idx = n - 1;
    return (double)v[idx] / 1000.0;
}

static void usage(void) {
    fprintf(stderr,
            "usage: loadgen --port P[,P...] [--host H] [--connections N] (--duration S | --count N)\n"
            "               [--warmup S] [--timeout S] [--template FILE] [--prefix ID] [--patients K]\n"
            "               [--reconnect]\n"
            "Connection i goes to the i-th port of the list (round robin). Prints one JSON line.\n");
    exit(2);
}

int main(int argc, char **argv) {
    opt.host = "127.0.0.1";
    opt.connections = 1;
    opt.timeout = 30;
    static char default_prefix[16];
    snprintf(default_prefix, sizeof default_prefix, "%lx", ((unsigned long)time(NULL) ^ ((unsigned long)getpid() << 16)) & 0xffffffUL);
    opt.prefix = default_prefix;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDV() do { if (!v) usage(); i++; } while (0)
        if (!strcmp(a, "--host")) { NEEDV(); opt.host = v; }
        else if (!strcmp(a, "--port")) {
            NEEDV();
            char *copy = strdup(v), *save = NULL;
            for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                if (opt.nports == MAX_PORTS) die("too many ports");
                opt.ports[opt.nports++] = atoi(tok);
            }
            free(copy);
        }
        else if (!strcmp(a, "--connections")) { NEEDV(); opt.connections = atoi(v); }
        else if (!strcmp(a, "--duration")) { NEEDV(); opt.duration = atof(v); }
        else if (!strcmp(a, "--count")) { NEEDV(); opt.count = atol(v); }
        else if (!strcmp(a, "--warmup")) { NEEDV(); opt.warmup = atof(v); }
        else if (!strcmp(a, "--timeout")) { NEEDV(); opt.timeout = atof(v); }
        else if (!strcmp(a, "--template")) { NEEDV(); opt.template_path = v; }
        else if (!strcmp(a, "--prefix")) { NEEDV(); opt.prefix = v; }
        else if (!strcmp(a, "--patients")) { NEEDV(); opt.patients = atoi(v); }
        else if (!strcmp(a, "--reconnect")) { opt.reconnect = 1; }
        else usage();
    }
    if (opt.nports == 0 || opt.connections < 1 || (opt.duration <= 0) == (opt.count <= 0) || opt.timeout <= 0)
        usage();
    for (int i = 0; i < opt.nports; i++)
        if (opt.ports[i] < 1 || opt.ports[i] > 65535)
            die("bad port");
    prepare_template();
    clock_gettime(CLOCK_MONOTONIC, &t_zero);
    atomic_store(&remaining, opt.count);

    struct conn_stats *stats = calloc((size_t)opt.connections, sizeof *stats);
    pthread_t *threads = calloc((size_t)opt.connections, sizeof *threads);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < opt.connections; i++) {
        stats[i].index = i;
        stats[i].port = opt.ports[i % opt.nports];
        if (pthread_create(&threads[i], &attr, conn_thread, &stats[i]) != 0)
            die("cannot start a thread");
    }
    while (atomic_load(&ready_threads) < opt.connections) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    struct rusage ru0;
    getrusage(RUSAGE_SELF, &ru0);
    t_start = now_s();
    t_measure = t_start + opt.warmup;
    t_end_send = opt.duration > 0 ? t_measure + opt.duration : 1e18;
    atomic_store(&go, 1);
    for (int i = 0; i < opt.connections; i++)
        pthread_join(threads[i], NULL);
    double t_done = now_s();
    struct rusage ru1;
    getrusage(RUSAGE_SELF, &ru1);

    long total_lat = 0, measured = 0, acked = 0, sent = 0, reconnects = 0, mismatched = 0, unacked = 0;
    long errors[E_KINDS] = {0};
    double last_ack = t_measure;
    struct conn_stats merged = {0};
    for (int i = 0; i < opt.connections; i++) {
        struct conn_stats *st = &stats[i];
        total_lat += st->nlat;
        measured += st->measured;
        acked += st->acked;
        sent += st->sent_ids;
        reconnects += st->reconnects;
        mismatched += st->mismatched;
        unacked += st->unacked;
        for (int k = 0; k < E_KINDS; k++)
            errors[k] += st->errors[k];
        for (int c = 0; c < st->ncodes; c++)
            for (long n = 0; n < st->code_counts[c]; n++)
                count_code(&merged, st->codes[c], strlen(st->codes[c]));
        if (st->last_ack > last_ack)
            last_ack = st->last_ack;
    }
    uint32_t *all = malloc((size_t)(total_lat ? total_lat : 1) * sizeof(uint32_t));
    long pos = 0;
    double sum = 0;
    for (int i = 0; i < opt.connections; i++) {
        memcpy(all + pos, stats[i].lat_us, (size_t)stats[i].nlat * sizeof(uint32_t));
        pos += stats[i].nlat;
    }
    for (long i = 0; i < total_lat; i++)
        sum += all[i];
    qsort(all, (size_t)total_lat, sizeof(uint32_t), cmp_u32);
    double window = last_ack - t_measure;
    if (opt.duration > 0 && window < opt.duration)
        window = opt.duration;
    double cpu = (double)(ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) + (double)(ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) / 1e6 +
                 (double)(ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) + (double)(ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec) / 1e6;
    long total_errors = 0;
    for (int k = 0; k < E_KINDS; k++)
        total_errors += errors[k];

    printf("{\"connections\":%d,\"prefix\":\"%s\",\"message_bytes\":%ld,", opt.connections, opt.prefix,
           atomic_load(&frame_bytes));
    printf("\"sent\":%ld,\"acked\":%ld,\"measured\":%ld,\"unacked\":%ld,", sent, acked, measured, unacked);
    printf("\"window_s\":%.6f,\"msg_per_s\":%.1f,", window, window > 0 ? (double)measured / window : 0.0);
    printf("\"latency_ms\":{\"p50\":%.3f,\"p90\":%.3f,\"p99\":%.3f,\"p999\":%.3f,\"max\":%.3f,\"mean\":%.3f},",
           pct(all, total_lat, 0.50), pct(all, total_lat, 0.90), pct(all, total_lat, 0.99),
           pct(all, total_lat, 0.999), total_lat ? (double)all[total_lat - 1] / 1000.0 : 0.0,
           total_lat ? sum / (double)total_lat / 1000.0 : 0.0);
    printf("\"ack_codes\":{");
    for (int c = 0; c < merged.ncodes; c++)
        printf("%s\"%s\":%ld", c ? "," : "", merged.codes[c], merged.code_counts[c]);
    printf("},\"ack_mismatched\":%ld,\"errors\":%ld,\"error_kinds\":{", mismatched, total_errors);
    int first = 1;
    for (int k = 0; k < E_KINDS; k++) {
        if (errors[k]) {
            printf("%s\"%s\":%ld", first ? "" : ",", ERR_NAMES[k], errors[k]);
            first = 0;
        }
    }
    printf("},\"reconnects\":%ld,", reconnects);
    printf("\"cpu_s\":%.3f,\"wall_s\":%.3f,", cpu, t_done - t_start);
    printf("\"t_start_mono\":%.6f,\"t_measure_mono\":%.6f,\"t_end_mono\":%.6f,", mono_abs(t_start), mono_abs(t_measure),
           mono_abs(last_ack > t_measure ? last_ack : t_done));
    printf("\"per_connection\":[");
    for (int i = 0; i < opt.connections; i++)
        printf("%s{\"port\":%d,\"sent_ids\":%ld,\"acked\":%ld,\"unacked\":%d}", i ? "," : "", stats[i].port,
               stats[i].sent_ids, stats[i].acked, stats[i].unacked);
    printf("]}\n");
    fflush(stdout);
    return 0;
}
