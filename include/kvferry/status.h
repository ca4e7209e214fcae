/*
 * kvferry status codes.
 *
 * One X-macro table generates the enum, kvf_status_name() and
 * kvf_status_str(), so the three cannot drift apart.  KVF_OK is 0, every
 * error is negative, and no value is ever an errno: operating-system errors
 * travel in their own field (the failure record's reason names them).
 *
 * Codes are grouped by blast radius, the way UCX groups its own:
 *   -1 .. -19   call / engine level: the call was refused, nothing happened
 *   -20 .. -39  room level: one room failed, its peers and engine are fine
 *   -40 .. -59  peer level: a connection or a peer failed; every room that
 *               depends on that peer fails with it
 */
#ifndef KVFERRY_STATUS_H
#define KVFERRY_STATUS_H

#define KVF_STATUS_TABLE(X)                                                    \
    X(KVF_OK,                   0,  "success")                                 \
    /* call / engine level */                                                  \
    X(KVF_ERR_INVALID_PARAM,   -1,  "invalid parameter")                       \
    X(KVF_ERR_NO_MEMORY,       -2,  "out of memory")                           \
    X(KVF_ERR_STATE,           -3,  "call not allowed in the current state")   \
    X(KVF_ERR_OUT_OF_RANGE,    -4,  "index outside the registered buffers")    \
    X(KVF_ERR_ROOM_IN_USE,     -5,  "room id already in use on this engine")   \
    X(KVF_ERR_IO,              -6,  "operating-system I/O error")              \
    X(KVF_ERR_NOT_FOUND,       -7,  "not found")                               \
    X(KVF_ERR_UNSUPPORTED,     -8,  "unsupported configuration")               \
    X(KVF_ERR_AGAIN,           -9,  "no result yet; try again later")          \
    /* room level */                                                           \
    X(KVF_ERR_TIMED_OUT,      -20,  "room deadline expired")                   \
    X(KVF_ERR_ABORTED,        -21,  "room aborted")                            \
    X(KVF_ERR_BAD_INDICES,    -22,  "page or slot indices rejected")           \
    X(KVF_ERR_INCOMPLETE,     -23,  "byte count mismatch: transfer incomplete")\
    X(KVF_ERR_CHECKSUM,       -24,  "checksum mismatch")                       \
    X(KVF_ERR_ROOM_CONFLICT,  -25,  "room id reused while the room is live")   \
    X(KVF_ERR_BOOTSTRAP,      -26,  "bootstrap registry lookup failed")        \
    X(KVF_ERR_LEASE_EXPIRED,  -27,  "held room's lease ended before its readers came") \
    /* peer level */                                                           \
    X(KVF_ERR_CONN_RESET,     -40,  "connection to peer lost")                 \
    X(KVF_ERR_UNREACHABLE,    -41,  "peer unreachable")                        \
    X(KVF_ERR_PEER_TIMEOUT,   -42,  "peer stopped answering heartbeats")       \
    X(KVF_ERR_PROTOCOL,       -43,  "protocol violation by peer")              \
    X(KVF_ERR_INCOMPATIBLE,   -44,  "prefill and decode configurations are incompatible") \
    X(KVF_ERR_VERSION,        -45,  "unsupported wire protocol version")       \
    X(KVF_ERR_PEER_RESTARTED, -46,  "peer restarted with a new instance")     \
    X(KVF_ERR_AUTH,           -47,  "peer failed authentication (cluster token)")

typedef enum kvf_status {
#define KVF_STATUS_ENUM_(name, value, text) name = value,
    KVF_STATUS_TABLE(KVF_STATUS_ENUM_)
#undef KVF_STATUS_ENUM_
} kvf_status_t;

#endif /* KVFERRY_STATUS_H */
