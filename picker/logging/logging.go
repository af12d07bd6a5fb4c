// Package logging gives the picker's log lines the one level logr lacks:
// warning. A warning is something the picker goes on despite, that an
// operator should fix (a setting it cannot apply, an endpoint it cannot
// read); it is not an error, which stops something from working.
//
// logr has only Info (with a verbosity) and Error, and clamps a negative
// verbosity to 0, so no V level can reach zap's Warn. Warn therefore logs an
// Info line at V(0) carrying WarningKey=true, and WarnLevel, a zap core
// wrapper installed where the binary builds its logger, turns such a line
// into a warn-level entry and drops the key. Any other logr sink (a test's,
// a library user's) still shows the line at the default verbosity with
// "warning"=true, so the meaning survives whatever the sink.
//
// The invariant not to break: Warn always logs at V(0), the default
// verbosity, so a warning is never hidden by the default -v.
package logging

import (
	"slices"

	"github.com/go-logr/logr"
	"go.uber.org/zap/zapcore"
)

// WarningKey marks a log line as a warning; see Warn.
const WarningKey = "warning"

// Warn logs msg with keysAndValues as a warning, at the default verbosity.
func Warn(log logr.Logger, msg string, keysAndValues ...any) {
	// logr reports the caller one frame up; this helper is that frame.
	log.WithCallDepth(1).Info(msg, append([]any{WarningKey, true}, keysAndValues...)...)
}

// WarnLevel wraps a zap core so that an info entry carrying WarningKey=true
// (Warn's) is written at zap's warn level, without the key. Install it
// innermost (zap.WrapCore before any sampler), so that the level change
// happens at Write, after the wrapping cores have checked the entry.
func WarnLevel(c zapcore.Core) zapcore.Core { return warnCore{c} }

type warnCore struct{ zapcore.Core }

func (c warnCore) With(fields []zapcore.Field) zapcore.Core {
	return warnCore{c.Core.With(fields)}
}

func (c warnCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c warnCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	if e.Level == zapcore.InfoLevel {
		if i := slices.IndexFunc(fields, isWarningMark); i >= 0 {
			e.Level = zapcore.WarnLevel
			fields = slices.Delete(slices.Clone(fields), i, i+1)
		}
	}
	return c.Core.Write(e, fields)
}

func isWarningMark(f zapcore.Field) bool {
	return f.Key == WarningKey && f.Type == zapcore.BoolType && f.Integer == 1
}
