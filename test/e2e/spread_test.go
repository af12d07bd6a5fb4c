package e2e

import (
	"net/http"
	"net/netip"
	"slices"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/tallyepp/tally/internal/stack"
)

var spreadFirstPodIP = netip.MustParseAddr("127.0.52.2")

// A cluster's gateway spreads its ext_proc streams over the ready
// endpoints of the picker's Service; with peers every replica serves them.
var _ = Describe("A gateway in front of every picker replica", Ordered, func() {
	var ps *stack.Stack
	var follower *stack.Replica
	var url string

	BeforeAll(func(ctx SpecContext) {
		ps = startStack(ctx, stack.Options{
			Namespace:  "e2e-spread",
			PoolName:   "spread-pool",
			Pods:       3,
			FirstPodIP: spreadFirstPodIP,
			TimeScale:  10,
			Peers:      true,
			PickerArgs: leaseArgs,
		})
		var err error
		follower, err = ps.StartReplica(ctx)
		Expect(err).NotTo(HaveOccurred())
		url, err = ps.StartSpreadGateway(ctx)
		Expect(err).NotTo(HaveOccurred())
	}, NodeTimeout(2*time.Minute))

	requestsOf := func(ctx SpecContext, read func() (stack.Metrics, error)) float64 {
		GinkgoHelper()
		m, err := read()
		Expect(err).NotTo(HaveOccurred())
		return m.Sum("tally_requests_total")
	}

	It("sends the streams to each replica in turn, and a dead replica's turn to the next", func(ctx SpecContext) {
		leaderBefore := requestsOf(ctx, func() (stack.Metrics, error) { return ps.PickerMetrics(ctx) })
		followerBefore := requestsOf(ctx, func() (stack.Metrics, error) { return follower.Metrics(ctx) })
		const n = 8
		for range n {
			r := stack.Send(ctx, ps.HTTPClient(), url, nextID("spread"), completion("spread", true))
			Expect(r.Err).NotTo(HaveOccurred())
			Expect(r.Status).To(Equal(http.StatusOK))
		}
		// Each picker counts a request once its stream has ended.
		eventually(ctx, func() []float64 {
			return []float64{
				requestsOf(ctx, func() (stack.Metrics, error) { return ps.PickerMetrics(ctx) }) - leaderBefore,
				requestsOf(ctx, func() (stack.Metrics, error) { return follower.Metrics(ctx) }) - followerBefore,
			}
		}).WithTimeout(10*time.Second).Should(Equal([]float64{n / 2, n / 2}), "streams per picker (first, replica)")

		follower.Kill()
		var statuses []int
		for range n {
			r := stack.Send(ctx, ps.HTTPClient(), url, nextID("spread-after-kill"), completion("spread", true))
			Expect(r.Err).NotTo(HaveOccurred())
			statuses = append(statuses, r.Status)
		}
		Expect(slices.Compact(statuses)).To(Equal([]int{http.StatusOK}), "every request served through the live picker")
	})
})
