//go:build !linux

package stack

import "syscall"

// childProcAttr: only Linux can tie a child's life to its parent's; elsewhere
// Stop is the only cleanup.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{}
}
