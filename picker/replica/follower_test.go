package replica

import (
	"context"
	"net/netip"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
)

// The peer list may come (from the pod watcher) while Run starts: Run must
// not undo it with the list it found when it started, or the replica
// follows no one until the next pod changes.
func TestPeersSetWhileRunStartsAreFollowed(t *testing.T) {
	peers := []Peer{{Name: "a"}, {Name: "b", Addr: netip.MustParseAddrPort("127.0.0.1:1")}}
	for i := range 1000 {
		x := New(picker.New(v1alpha1.PickerConfig{}, picker.Options{}), Options{Self: "a", Registerer: prometheus.NewRegistry()})
		ctx, stop := context.WithCancel(context.Background())
		go x.Run(ctx)
		runtime.Gosched()
		x.SetPeers(peers)
		for {
			x.mu.Lock()
			started, c := x.ctx != nil, x.peers["b"]
			x.mu.Unlock()
			if !started {
				runtime.Gosched()
				continue
			}
			if c == nil || c.peer.Addr != peers[1].Addr {
				stop()
				t.Fatalf("try %d: SetPeers named peer b while Run started, and the replica does not follow it", i)
			}
			break
		}
		stop()
	}
}
