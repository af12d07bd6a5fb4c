package stack

import "syscall"

// childProcAttr makes the kernel kill a child when the stack's process dies,
// so a crashed demo or test binary leaves no picker or gateway behind.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
