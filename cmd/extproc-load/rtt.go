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
	"sync"
	"time"
)

// The bare round trip: while load runs against several replicas, the tool
// also sends small messages over plain TCP to another process of its own
// (the echo command) and times their echoes. A follower's pick crosses
// the same loopback to the leader and back, so this is what forwarding
// cannot cost less than on the machine, under the same load.

// rttMessageBytes is the size of a probe message, about a forwarded pick's.
const rttMessageBytes = 200

// echoCommand is the hidden command the tool runs itself as to answer the
// probe.
const echoCommand = "echo"

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

// runEcho is the echo command: it listens on loopback, prints its address
// on stdout and echoes until stdin closes (the tool that started it ended).
func runEcho(stdin io.Reader, stdout io.Writer) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		l.Close()
	}()
	if _, err := fmt.Fprintln(stdout, l.Addr()); err != nil {
		return err
	}
	return serveEcho(l)
}

// startEcho runs this executable's echo command and returns its address
// and a function that ends it.
func startEcho(ctx context.Context) (string, func(), error) {
	self, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.CommandContext(ctx, self, echoCommand)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return "", nil, fmt.Errorf("starting the echo process: %w", err)
	}
	stop := func() {
		stdin.Close()
		_ = cmd.Wait()
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		stop()
		return "", nil, fmt.Errorf("the echo process printed no address: %w", err)
	}
	return strings.TrimSpace(line), stop, nil
}

// rttProbe times a message's echo every interval until stopped.
type rttProbe struct {
	mu      sync.Mutex
	samples []rttSample
	err     error
	stop    chan struct{}
	done    chan struct{}
}

type rttSample struct {
	at  time.Time
	rtt time.Duration
}

// startProbe dials the echo server at addr and starts timing.
func startProbe(addr string, interval time.Duration) (*rttProbe, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &rttProbe{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer c.Close()
		out := bytes.Repeat([]byte{'p'}, rttMessageBytes)
		in := make([]byte, rttMessageBytes)
		r := bufio.NewReader(c)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
			}
			start := time.Now()
			_, err := c.Write(out)
			if err == nil {
				_, err = io.ReadFull(r, in)
			}
			if err == nil && !bytes.Equal(in, out) {
				err = errors.New("the echo differs from the message")
			}
			p.mu.Lock()
			if err != nil {
				p.err = fmt.Errorf("bare round trip: %w", err)
				p.mu.Unlock()
				return
			}
			p.samples = append(p.samples, rttSample{at: start, rtt: time.Since(start)})
			p.mu.Unlock()
		}
	}()
	return p, nil
}

// end stops the probe and returns the round trips that started in
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
