# The batched UDP calls of udp_batch.h (segmentation offload, GRO), for every loop that
# moves datagrams: the worker's transport, the switch and the benchmarks' load generator.
from libc.stdint cimport int32_t, uint8_t, uint16_t

from netio cimport mmsghdr, msghdr, sockaddr_in

cdef extern from "udp_batch.h" nogil:
    enum:
        INA_BATCH_MAX        # datagrams one ina_send_batch call takes
        INA_GRO_CONTROL      # control-message bytes per received message (UDP_GRO)
        INA_GSO_MAX_BYTES    # a segmented send's largest total
    int ina_send_segmented(int fd, const sockaddr_in *to, uint8_t *const *bufs,
                           const int32_t *lens, int n, uint16_t size)
    int ina_send_no_room(int err)
    int ina_send_batch(int fd, const sockaddr_in *to, uint8_t *const *bufs,
                       const int32_t *lens, int count, int *gso, long *calls,
                       long *refused)
    void ina_attach_controls(mmsghdr *msgs, char *controls, size_t stride, int count)
    int ina_gro_size(msghdr *msg)
    int ina_segments(msghdr *msg, uint8_t *base, size_t total, uint8_t **ptrs,
                     int32_t *lens, int max)
