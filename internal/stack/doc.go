// Package stack runs Tally end to end on loopback addresses, for the demo
// (cmd/demo) and the end-to-end suite (test/e2e): a real kube-apiserver and
// etcd, an InferencePool with pods whose IPs are 127.0.0.x, one simulated
// vLLM server per pod IP, the picker (cmd/epp) and the dev gateway
// (cmd/devgateway) as processes, more picker replicas with gateways of
// their own for leader election (StartReplica), and a real NGINX with NGINX
// Gateway Fabric's shim (cmd/ngf-shim) in front of the picker (StartNGINX).
// It also loads the Mooncake trace, builds workloads, replays them and
// summarises what the clients measured.
//
// The invariant: everything a Stack starts (processes, servers, temporary
// files, the API server) is stopped by its Stop, whatever failed on the way,
// so a failed demo or suite leaves nothing running.
package stack
