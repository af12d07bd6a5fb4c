package extproc

import (
	"bytes"
	"encoding/json"
	"sync"
)

// usageScanner reads the top-level `usage` of a non-streamed JSON response
// body wherever it stands (vLLM writes it after the choices, other servers
// before them), as the body's chunks pass: it keeps no more of the body
// than the usage object itself, in a buffer of usageTailBytes taken from
// the pool only while that object passes, and reads each byte once.
//
// It follows only what it needs to tell a key of the top-level object from
// everything else: the depth of brackets, and strings (where brackets and
// quotes do not count). It does not validate: on a body that is not JSON it
// reads nothing sensible, but never more than the bound. A key is matched as
// written, so a "usage" key spelled with escapes is not seen (no server
// writes one); a key that appears twice is read from its last value, as
// encoding/json does.
//
// The zero value is ready; only the stream's goroutine touches it.
type usageScanner struct {
	// depth counts the brackets open: 0 outside the top-level value, 1
	// inside the top-level object.
	depth int
	// at is, at depth 1, what comes next in the top-level object.
	at scanAt
	// inString: inside a string that is not a top-level key; inKey: inside
	// a top-level key, whose first keyLen bytes match "usage" (-1: they do
	// not). escaped: the last chunk ended inside an escape (its backslash).
	inString, inKey, escaped bool
	keyLen                   int
	// usageNext: the last key read was "usage", its value comes next.
	usageNext bool
	// capturing: the usage object is passing; buf holds its first n bytes
	// (-1: it outgrew buf).
	capturing bool
	buf       *[usageTailBytes]byte
	n         int
	// stopped: the body is not a JSON object (or objects, one after the
	// other); nothing more is read.
	stopped bool
	// u and ok are what the last usage value read said.
	u  usage
	ok bool
}

// bracketOrQuote marks the bytes that count below the top level.
var bracketOrQuote = [256]bool{'"': true, '{': true, '}': true, '[': true, ']': true}

type scanAt uint8

const (
	scanKey   scanAt = iota // after '{' or ','
	scanColon               // after a key
	scanValue               // after ':'
	scanAfter               // after a value
)

// write scans the next chunk of the body; pool holds the capture buffers.
func (s *usageScanner) write(p []byte, pool *sync.Pool) {
	if s.stopped {
		return
	}
	start := 0 // where the usage object's bytes begin in p, while capturing
	for i := 0; i < len(p); {
		switch {
		case s.inString:
			i = s.skipString(p, i)
			continue
		case s.inKey:
			s.keyByte(p[i])
			i++
			continue
		}
		if s.depth > 1 {
			// Below the top level only strings and brackets count: the
			// bytes between them (numbers, keys' colons) are passed over.
			for i < len(p) && !bracketOrQuote[p[i]] {
				i++
			}
			if i == len(p) {
				break
			}
			c := p[i]
			i++
			switch c {
			case '"':
				s.inString = true
			case '{', '[':
				s.depth++
			case '}', ']':
				if s.depth--; s.depth == 1 {
					s.at = scanAfter
					if s.capturing {
						s.keep(p[start:i])
						s.finish(pool)
					}
				}
			}
			continue
		}
		c := p[i]
		i++
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		if s.depth == 0 {
			if c != '{' {
				s.stopped = true
				return
			}
			s.depth, s.at = 1, scanKey
			continue
		}
		switch c {
		case '"':
			if s.at == scanKey {
				s.inKey, s.keyLen = true, 0
				continue
			}
			s.value()
			s.inString = true
		case ':':
			s.at = scanValue
		case ',':
			s.at, s.usageNext = scanKey, false
		case '{', '[':
			if c == '{' && s.usageNext && s.at == scanValue {
				s.usageNext, s.capturing, s.n, start = false, true, 0, i-1
				if s.buf == nil {
					s.buf = pool.Get().(*[usageTailBytes]byte)
				}
			}
			s.value()
			s.depth++
		case '}', ']':
			s.depth, s.usageNext = 0, false
		default: // a number, true, false or null
			s.value()
		}
	}
	if s.capturing {
		s.keep(p[start:])
	}
}

// value notes that a value of the top-level object begins; if it belongs to
// a "usage" key and is not an object (null), the response has no usage.
func (s *usageScanner) value() {
	if s.usageNext {
		s.usageNext, s.u, s.ok = false, usage{}, false
	}
	s.at = scanAfter
}

// keyByte reads the next byte of a top-level key.
func (s *usageScanner) keyByte(c byte) {
	const key = "usage"
	switch {
	case s.escaped:
		s.escaped = false
	case c == '\\':
		s.escaped, s.keyLen = true, -1
	case c == '"':
		s.inKey, s.at, s.usageNext = false, scanColon, s.keyLen == len(key)
	case s.keyLen >= 0 && s.keyLen < len(key) && c == key[s.keyLen]:
		s.keyLen++
	default:
		s.keyLen = -1
	}
}

// skipString passes over the string p[i:] is in, up to and including its
// closing quote, and returns where it stopped. The generated text of a
// response is one long string: it is skipped quote to quote with
// IndexByte, a quote being the string's end when an even run of
// backslashes stands before it (each pair is one escaped backslash).
func (s *usageScanner) skipString(p []byte, i int) int {
	if s.escaped { // the last chunk ended inside an escape
		if i == len(p) {
			return i
		}
		s.escaped = false
		i++
	}
	// Most strings below the top level are short (keys, logprobs'
	// tokens): a plain loop ends them sooner than IndexByte's setup.
	for end := min(i+16, len(p)); i < end; i++ {
		switch p[i] {
		case '\\':
			if i++; i == len(p) {
				s.escaped = true
				return i
			}
		case '"':
			s.inString = false
			return i + 1
		}
	}
	for {
		q := bytes.IndexByte(p[i:], '"')
		if q < 0 {
			// An odd run of backslashes at the end escapes the next
			// chunk's first byte.
			s.escaped = backslashesBefore(p[i:], len(p)-i)%2 == 1
			return len(p)
		}
		q += i
		if backslashesBefore(p[i:], q-i)%2 == 0 {
			s.inString = false
			return q + 1
		}
		i = q + 1
	}
}

// backslashesBefore counts the backslashes just before p[end].
func backslashesBefore(p []byte, end int) int {
	n := 0
	for ; end > 0 && p[end-1] == '\\'; end-- {
		n++
	}
	return n
}

// keep adds b to the usage object captured, or marks it as outgrowing the
// buffer.
func (s *usageScanner) keep(b []byte) {
	if s.n < 0 {
		return
	}
	if s.n+len(b) > len(s.buf) {
		s.n = -1
		return
	}
	s.n += copy(s.buf[s.n:], b)
}

// finish reads the usage object captured and gives the buffer back.
func (s *usageScanner) finish(pool *sync.Pool) {
	s.capturing = false
	s.u, s.ok = usage{}, false
	var w wireUsage
	if s.n >= 0 && json.Unmarshal(s.buf[:s.n], &w) == nil {
		s.u, s.ok = w.usage(), true
	}
	pool.Put(s.buf)
	s.buf = nil
}

// close gives the capture buffer, if held, back to pool and reads no more.
func (s *usageScanner) close(pool *sync.Pool) {
	if s.buf != nil {
		pool.Put(s.buf)
		s.buf = nil
	}
	s.stopped, s.capturing = true, false
}
