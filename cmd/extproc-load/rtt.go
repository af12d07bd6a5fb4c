package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The bare round trip: while load runs against several replicas with
// --bare-rtt, the tool also sends small messages to another process of its own (the echo
// command) and times their echoes, over plain TCP and over a gRPC stream
// without TLS. A follower's pick crosses the same loopback to the leader
// and back on a gRPC stream, so these are what forwarding cannot cost less
// than on the machine, under the same load, without the peer stream's
// TLS and with no work at either end.

// rttMessageBytes is the size of a probe message, about a forwarded pick's.
const rttMessageBytes = 200

// echoCommand is the hidden command the tool runs itself as to answer the
// probes.
const echoCommand = "echo"

// The gRPC echo: one bidirectional stream of BytesValue messages.
const echoMethod = "/tally.load.Echo/Echo"

var echoService = grpc.ServiceDesc{
	ServiceName: "tally.load.Echo",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{StreamName: "Echo", ServerStreams: true, ClientStreams: true,
		Handler: func(_ any, s grpc.ServerStream) error {
			for {
				m := new(wrapperspb.BytesValue)
				if err := s.RecvMsg(m); err != nil {
					if errors.Is(err, io.EOF) {
						return nil
					}
					return err
				}
				if err := s.SendMsg(m); err != nil {
					return err
				}
			}
		}}},
}

// serveEcho answers every rttMessageBytes read on a connection with the
// same bytes, until the listener closes.
func serveEcho(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go func() {
			defer c.Close()
			r := bufio.NewReader(c)
			b := make([]byte, rttMessageBytes)
			for {
				if _, err := io.ReadFull(r, b); err != nil {
					return
				}
				if _, err := c.Write(b); err != nil {
					return
				}
			}
		}()
	}
}

// echoAddrs are where an echo process answers.
type echoAddrs struct{ tcp, grpc string }

// runEcho is the echo command: it listens on loopback, prints its TCP and
// gRPC addresses on one line of stdout and echoes until stdin closes (the
// tool that started it ended).
func runEcho(stdin io.Reader, stdout io.Writer) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	gl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	gs := grpc.NewServer()
	gs.RegisterService(&echoService, nil)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(gl) }()
	defer func() {
		gs.Stop()
		<-served
	}()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		l.Close()
	}()
	if _, err := fmt.Fprintln(stdout, l.Addr(), gl.Addr()); err != nil {
		return err
	}
	return serveEcho(l)
}

// startEcho runs this executable's echo command and returns its addresses
// and a function that ends it.
func startEcho(ctx context.Context) (echoAddrs, func(), error) {
	self, err := os.Executable()
	if err != nil {
		return echoAddrs{}, nil, err
	}
	cmd := exec.CommandContext(ctx, self, echoCommand)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return echoAddrs{}, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return echoAddrs{}, nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return echoAddrs{}, nil, fmt.Errorf("starting the echo process: %w", err)
	}
	stop := func() {
		stdin.Close()
		_ = cmd.Wait()
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 2 {
		stop()
		return echoAddrs{}, nil, fmt.Errorf("the echo process printed no addresses (%q): %v", line, err)
	}
	return echoAddrs{tcp: f[0], grpc: f[1]}, stop, nil
}

// roundTrip sends a message and returns its echo.
type roundTrip func(out []byte) (in []byte, err error)

// dialTCP is a round trip over a TCP connection to an echo process.
func dialTCP(addr string) (roundTrip, func(), error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	r := bufio.NewReader(c)
	in := make([]byte, rttMessageBytes)
	return func(out []byte) ([]byte, error) {
		if _, err := c.Write(out); err != nil {
			return nil, err
		}
		_, err := io.ReadFull(r, in)
		return in, err
	}, func() { c.Close() }, nil
}

// dialGRPC is a round trip over a gRPC stream (no TLS) to an echo process.
func dialGRPC(addr string) (roundTrip, func(), error) {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := cc.NewStream(ctx, &echoService.Streams[0], echoMethod)
	if err != nil {
		cancel()
		cc.Close()
		return nil, nil, err
	}
	return func(out []byte) ([]byte, error) {
			if err := s.SendMsg(wrapperspb.Bytes(out)); err != nil {
				return nil, err
			}
			m := new(wrapperspb.BytesValue)
			err := s.RecvMsg(m)
			return m.GetValue(), err
		}, func() {
			cancel()
			cc.Close()
		}, nil
}

// rttNames name the bare round trips, in startProbes' order.
var rttNames = []string{"TCP", "gRPC"}

// startProbes starts timing both bare round trips to an echo process.
func startProbes(a echoAddrs, every time.Duration) ([]*rttProbe, error) {
	tcp, closeTCP, err := dialTCP(a.tcp)
	if err != nil {
		return nil, err
	}
	g, closeGRPC, err := dialGRPC(a.grpc)
	if err != nil {
		closeTCP()
		return nil, err
	}
	return []*rttProbe{startProbe(rttNames[0], tcp, closeTCP, every), startProbe(rttNames[1], g, closeGRPC, every)}, nil
}

// rttResult is one bare round trip over a load's window.
type rttResult struct {
	name     string
	every    time.Duration
	n        int
	p50, p99 time.Duration
	// leaderPlusP99 is the p99 of the leader's picks each plus one of
	// these round trips: a follower's, were forwarding to cost only the
	// bare round trip (0 when no replica is known to lead).
	leaderPlusP99 time.Duration
}

// rttProbe times a round trip every interval until ended.
type rttProbe struct {
	samples []rttSample
	err     error
	stop    chan struct{}
	done    chan struct{}
}

type rttSample struct {
	at  time.Time
	rtt time.Duration
}

// startProbe starts timing rt every interval; closing is called when it
// ends.
func startProbe(name string, rt roundTrip, closing func(), interval time.Duration) *rttProbe {
	p := &rttProbe{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer closing()
		out := bytes.Repeat([]byte{'p'}, rttMessageBytes)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
			}
			start := time.Now()
			in, err := rt(out)
			took := time.Since(start)
			if err == nil && !bytes.Equal(in, out) {
				err = errors.New("the echo differs from the message")
			}
			if err != nil {
				p.err = fmt.Errorf("bare %s round trip: %w", name, err)
				return
			}
			p.samples = append(p.samples, rttSample{at: start, rtt: took})
		}
	}()
	return p
}

// end stops the probe (the samples are the prober's until then) and
// returns the round trips that started in
// [from, until], sorted.
func (p *rttProbe) end(from, until time.Time) ([]time.Duration, error) {
	close(p.stop)
	<-p.done
	var d []time.Duration
	for _, s := range p.samples {
		if !s.at.Before(from) && !s.at.After(until) {
			d = append(d, s.rtt)
		}
	}
	slices.Sort(d)
	return d, p.err
}

// sumPercentile is the q-th percentile (nearest rank, as percentile) of
// a+b over every pair of a sample of a and one of b, both sorted: what
// the picks of a would take if each also waited one round trip of b,
// independently of its own time.
func sumPercentile(a, b []time.Duration, q float64) time.Duration {
	if len(a) == 0 || len(b) == 0 {
		return 0
	}
	pairs := len(a) * len(b)
	rank := int(q*float64(pairs-1)+0.5) + 1 // pairs at or under the answer
	// atMost counts the pairs whose sum is at most x.
	atMost := func(x time.Duration) int {
		n, j := 0, len(b)
		for _, v := range a {
			for j > 0 && v+b[j-1] > x {
				j--
			}
			n += j
		}
		return n
	}
	lo, hi := a[0]+b[0], a[len(a)-1]+b[len(b)-1]
	for lo < hi {
		mid := lo + (hi-lo)/2
		if atMost(mid) >= rank {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo
}
