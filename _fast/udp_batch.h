/* Many datagrams per system call: UDP segmentation offload (UDP_SEGMENT, Linux 4.18+)
 * where the kernel takes it, else sendmmsg; and receive coalescing (UDP_GRO, 5.0+). The per-packet cost of a send is mostly the
 * system call and the stack traversal (../shared/PITFALLS.md); one sendmsg carrying up to
 * 64 datagrams of one size pays it once.
 */
#ifndef INA_UDP_BATCH_H
#define INA_UDP_BATCH_H

#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define INA_GSO_MAX_SEGMENTS 64      /* the kernel's UDP_MAX_SEGMENTS */
#define INA_GSO_MAX_BYTES 65507      /* one UDP datagram's payload over IPv4 */
#define INA_BATCH_MAX 64

/* Whether a refused send means "no room now" (the socket's or the device queue's buffers
 * full: ENOBUFS under a shaping qdisc, EAGAIN on a full non-blocking socket): the
 * datagram is lost here as it could be on any link, and the sender's retransmission
 * timer recovers it. Any other errno is a failure of the path. */
static inline int ina_send_no_room(int err)
{
    return err == ENOBUFS || err == EAGAIN || err == EWOULDBLOCK;
}

/* Whether a failed UDP_SEGMENT send means "not here" (an old kernel, a device without
 * the offload) rather than a failure of this send: then the caller falls back. */
static inline int ina_gso_unsupported(int err)
{
    return err == EINVAL || err == ENOPROTOOPT || err == EOPNOTSUPP || err == EIO;
}

/* One sendmsg of n datagrams of `size` bytes (the last may be shorter), at bufs[0..n-1],
 * as one UDP_SEGMENT super-datagram. 0 or -1 (errno). */
static inline int ina_send_segmented(int fd, const struct sockaddr_in *to,
                                     uint8_t *const *bufs, const int32_t *lens, int n,
                                     uint16_t size)
{
    struct iovec iov[INA_GSO_MAX_SEGMENTS];
    char control[CMSG_SPACE(sizeof(uint16_t))];
    struct msghdr msg;
    struct cmsghdr *cm;
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = (size_t)lens[i];
    }
    memset(&msg, 0, sizeof msg);
    memset(control, 0, sizeof control);
    msg.msg_name = (void *)to;
    msg.msg_namelen = sizeof *to;
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)n;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    memcpy(CMSG_DATA(cm), &size, sizeof size);
    return sendmsg(fd, &msg, 0) < 0 ? -1 : 0;
}

/* Send datagrams bufs[i] (lens[i] bytes), i < count <= INA_BATCH_MAX, to `to`. While
 * *gso is 1, runs of equal-sized datagrams (a shorter last one allowed) leave as one
 * UDP_SEGMENT send each; a kernel that refuses the offload sets *gso to 0 for good. The
 * rest leave in one sendmmsg. *calls counts the system calls. A datagram refused for
 * want of room (ina_send_no_room) is dropped and counted in *refused, as a loss: the
 * batch goes on. 0, or -1 (errno set) if the kernel refused a send for another reason. */
static inline int ina_send_batch(int fd, const struct sockaddr_in *to,
                                 uint8_t *const *bufs, const int32_t *lens, int count,
                                 int *gso, long *calls, long *refused)
{
    struct mmsghdr msgs[INA_BATCH_MAX];
    struct iovec iovs[INA_BATCH_MAX];
    int i = 0, singles = 0, first_single = -1;
    while (i < count) {
        int n = 1;
        int32_t total = lens[i];
        if (*gso) {
            while (i + n < count && n < INA_GSO_MAX_SEGMENTS && lens[i + n] <= lens[i]
                   && total + lens[i + n] <= INA_GSO_MAX_BYTES) {
                total += lens[i + n];
                n++;
                if (lens[i + n - 1] < lens[i])
                    break;  /* a shorter datagram ends a run */
            }
        }
        if (n >= 2) {
            (*calls)++;
            if (ina_send_segmented(fd, to, bufs + i, lens + i, n, (uint16_t)lens[i]) == 0) {
                i += n;
                continue;
            }
            if (ina_send_no_room(errno)) {  /* the run is lost here, as on a full link */
                *refused += n;
                i += n;
                continue;
            }
            if (!ina_gso_unsupported(errno))
                return -1;
            *gso = 0;  /* this kernel or route has no UDP_SEGMENT: sendmmsg from now on */
            continue;
        }
        /* A datagram alone: gathered for one sendmmsg (its order against the runs does
         * not matter: each is a packet of its own slot). */
        memset(&msgs[singles], 0, sizeof msgs[singles]);
        iovs[singles].iov_base = bufs[i];
        iovs[singles].iov_len = (size_t)lens[i];
        msgs[singles].msg_hdr.msg_name = (void *)to;
        msgs[singles].msg_hdr.msg_namelen = sizeof *to;
        msgs[singles].msg_hdr.msg_iov = &iovs[singles];
        msgs[singles].msg_hdr.msg_iovlen = 1;
        if (first_single < 0)
            first_single = i;
        singles++;
        i++;
    }
    int sent = 0;
    while (sent < singles) {
        (*calls)++;
        int r = sendmmsg(fd, msgs + sent, (unsigned int)(singles - sent), 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (!ina_send_no_room(errno))
                return -1;
            (*refused)++;  /* the first of the rest was refused for want of room: lost */
            r = 1;
        }
        sent += r;
    }
    return 0;
}

/* Receiving with UDP_GRO: the kernel may hand over several datagrams of one flow as one
 * buffer, with their size in a control message. INA_GRO_CONTROL bytes of control space
 * per message hold it. */
#define INA_GRO_CONTROL 64

/* Point each of the count messages at its own control space (controls + i * stride,
 * stride >= INA_GRO_CONTROL), after prepare_receive, which clears them. */
static inline void ina_attach_controls(struct mmsghdr *msgs, char *controls, size_t stride,
                                       int count)
{
    for (int i = 0; i < count; i++) {
        msgs[i].msg_hdr.msg_control = controls + (size_t)i * stride;
        msgs[i].msg_hdr.msg_controllen = stride;
    }
}

/* The size of the datagrams a received buffer holds back to back (UDP_GRO), or 0 if it
 * is one datagram. */
static inline int ina_gro_size(struct msghdr *msg)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm != NULL; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(cm), sizeof size);
            return size;
        }
    }
    return 0;
}

/* The datagrams a received buffer (base, total bytes) holds: one, or several back to back
 * (UDP_GRO says their size; the last may be shorter). Their starts and lengths into ptrs
 * and lens, at most max (a GRO buffer holds at most 64; max >= 1); returns how many. */
static inline int ina_segments(struct msghdr *msg, uint8_t *base, size_t total,
                               uint8_t **ptrs, int32_t *lens, int max)
{
    size_t size = (size_t)ina_gro_size(msg), off = 0;
    int n = 0;
    if (size == 0 || size >= total)
        size = total;
    do {  /* at least one: an empty datagram is a datagram too */
        ptrs[n] = base + off;
        lens[n] = (int32_t)(total - off < size ? total - off : size);
        n++;
        off += size;
    } while (off < total && n < max);
    return n;
}

#endif
