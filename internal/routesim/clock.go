package routesim

import (
	"time"

	"k8s.io/utils/clock"
)

// virtualClock is the picker's clock in the simulation: Now reads the
// simulation's time, and the timers AfterFunc makes fire when the
// simulation's event loop reaches them (fire), in its goroutine.
type virtualClock struct {
	origin time.Time
	now    *time.Duration
	timers []*virtualTimer
}

type virtualTimer struct {
	c     *virtualClock
	at    time.Duration
	f     func()
	armed bool
}

func (c *virtualClock) Now() time.Time { return c.origin.Add(*c.now) }

func (c *virtualClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &virtualTimer{c: c, f: f}
	t.Reset(d)
	c.timers = append(c.timers, t)
	return t
}

// next is when the earliest armed timer fires; false when none is armed.
func (c *virtualClock) next() (time.Duration, bool) {
	var at time.Duration
	ok := false
	for _, t := range c.timers {
		if t.armed && (!ok || t.at < at) {
			at, ok = t.at, true
		}
	}
	return at, ok
}

// fire runs the timers due by now, each once.
func (c *virtualClock) fire() {
	for _, t := range c.timers {
		if t.armed && t.at <= *c.now {
			t.armed = false
			t.f()
		}
	}
}

func (t *virtualTimer) C() <-chan time.Time { return nil }

func (t *virtualTimer) Stop() bool {
	was := t.armed
	t.armed = false
	return was
}

func (t *virtualTimer) Reset(d time.Duration) bool {
	was := t.armed
	t.at, t.armed = *t.c.now+d, true
	return was
}
