package stack

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// processStopGrace is how long a process gets to exit after SIGTERM before
// it is killed. The picker and the gateway give streams 10 s on shutdown;
// nothing is in flight when a Stack stops them, so they exit sooner.
const processStopGrace = 15 * time.Second

// Process is a child process: the stack's pickers, gateways and NGINX, and
// the pickers the load tool (cmd/extproc-load) starts. It is the one
// supervisor of picker processes: what a process wrote is kept for error
// messages, it dies with its parent (Linux), and Stop gives it a grace
// period before it is killed.
type Process struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	// err is the result of Wait, set before done closes.
	err error

	mu    sync.Mutex
	lines []string // the last lines of output, for error messages
}

const keptOutputLines = 20

// startProcess starts path with args. Every line the process writes on
// stdout or stderr goes to out (nil: nowhere) prefixed with its name, and
// to onLine when set (it runs on the reading goroutine: keep it short).
func startProcess(name, path string, args []string, out io.Writer, onLine func(string)) (*Process, error) {
	return StartCommand(name, exec.Command(path, args...), out, onLine)
}

// StartCommand starts cmd as startProcess does: cmd sets what startProcess
// does not (an environment, for one). Its Stdout, Stderr and SysProcAttr
// are the supervisor's.
func StartCommand(name string, cmd *exec.Cmd, out io.Writer, onLine func(string)) (*Process, error) {
	path := cmd.Path
	cmd.SysProcAttr = childProcAttr()
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		return nil, fmt.Errorf("starting %s (%s): %w", name, path, err)
	}
	pw.Close() // the child holds its own copy; EOF comes when it exits
	p := &Process{name: name, cmd: cmd, done: make(chan struct{})}
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		defer pr.Close()
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.keep(line)
			if out != nil {
				fmt.Fprintf(out, "[%s] %s\n", name, line)
			}
			if onLine != nil {
				onLine(line)
			}
		}
	}()
	go func() {
		err := cmd.Wait()
		<-copied
		p.err = err
		close(p.done)
	}()
	return p, nil
}

func (p *Process) keep(line string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lines = append(p.lines, line)
	if len(p.lines) > keptOutputLines {
		p.lines = p.lines[len(p.lines)-keptOutputLines:]
	}
}

// Output returns the last lines the process wrote.
func (p *Process) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.lines, "\n")
}

// Pid is the process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// exitError describes how the process ended, with its last output.
func (p *Process) exitError() error {
	return fmt.Errorf("%s exited (%v); its last output:\n%s", p.name, p.err, p.Output())
}

// Stop asks the process to exit (SIGTERM), kills it after a grace period,
// and waits. Stopping a process that has exited returns nil.
func (p *Process) Stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("stopping %s: %w", p.name, err)
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(processStopGrace):
	}
	p.Kill()
	return fmt.Errorf("%s did not exit within %v of SIGTERM and was killed", p.name, processStopGrace)
}

// Kill ends the process at once (SIGKILL), as a crash would, and waits.
func (p *Process) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// waitFor polls check every interval until it returns true, the process
// exits, ctx ends or timeout passes.
func (p *Process) waitFor(ctx context.Context, what string, timeout, interval time.Duration, check func(context.Context) bool) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if check(ctx) {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("waiting for %s: %w", what, p.exitError())
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w; %s's last output:\n%s", what, ctx.Err(), p.name, p.Output())
		case <-t.C:
		}
	}
}

// stopAll stops the processes in order, passing over those never started
// (nil), and joins what they report.
func stopAll(ps ...*Process) error {
	var errs []error
	for _, p := range ps {
		if p != nil {
			errs = append(errs, p.Stop())
		}
	}
	return errors.Join(errs...)
}
