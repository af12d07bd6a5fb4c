// Package wire is the ext_proc server's hand-written gRPC codec: it decodes
// the ProcessingRequests gateways send without copying each body into a
// fresh slice, and writes the answers sent most (body echoes, the routing
// answer, constant answers) without protobuf's reflection.
//
// The invariant a newcomer must not break: the codec gives exactly what
// protobuf gives. A message it decodes equals proto.Unmarshal's (anything
// the fast decoder does not know goes to protobuf), and an answer it writes
// is, byte for byte, proto.Marshal's for the equivalent generated message
// (ProtoReflect). The tests and the fuzz target check both; a change to a
// field here needs its case there. Also: a body received into an Inbound
// aliases its buffer until the next message is received.
package wire
