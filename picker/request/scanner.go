package request

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth bounds how deeply containers may nest in a body, counting the
// top-level object as 1. encoding/json allows 10,000; real requests (tool
// schemas included) stay below 50. The bound keeps a hostile body from costing
// more than a fixed amount of scanner state.
const maxDepth = 1000

// scanner walks one JSON document once, left to right. It validates every
// byte it passes, decodes the strings the picker needs straight into dst and
// steps over everything else. pos always indexes buf; dst is the Prompt being
// built (and, past its logical end, scratch space for keys and short values).
type scanner struct {
	buf []byte
	pos int
	dst []byte
}

// runEnds finds where the plain runs of one JSON string end: at '"', '\\'
// or a control character (below 0x20). Text with escapes every few words
// has short runs, found fastest by testing a word at a time for all three;
// past shortRun bytes the run is long, and its end is the next quote or the
// next backslash before it, found by bytes.IndexByte (vector code) and
// remembered until the scan passes them (so a string is searched once
// however many escapes it has, and never past its closing quote), or a
// control character, which no valid string holds, checked a word at a time.
type runEnds struct {
	// The next '"' at or after the scan (len(b) if none), and the next '\\'
	// before it (quote if none); -1 until looked for.
	quote, slash int
}

const shortRun = 256

func newRunEnds() runEnds { return runEnds{quote: -1, slash: -1} }

// next returns the index of the first byte at or after i that is '"', '\\'
// or below 0x20, or len(b) if there is none. Successive calls must scan the
// same b with i never decreasing.
func (r *runEnds) next(b []byte, i int) int {
	if j := indexSpecial(b, i, min(i+shortRun, len(b))); j != i+shortRun {
		return j
	}
	return r.long(b, i+shortRun)
}

// long is next for a run already known to be long.
func (r *runEnds) long(b []byte, i int) int {
	if r.quote < i {
		r.quote = len(b)
		if j := bytes.IndexByte(b[i:], '"'); j >= 0 {
			r.quote = i + j
		}
	}
	if r.slash < i {
		r.slash = r.quote
		if j := bytes.IndexByte(b[i:r.quote], '\\'); j >= 0 {
			r.slash = i + j
		}
	}
	return indexControl(b, i, r.slash)
}

// Word-at-a-time constants. For a word x, (x-lsb)&^x&msb flags its zero
// bytes and (x-spaces)&^x&msb its bytes below 0x20 (so x^quotes turns quotes
// into zeros); a borrow can only flag bytes above a true hit, so the lowest
// flagged byte is always exact.
const (
	lsb         = 0x0101010101010101
	msb         = 0x8080808080808080
	quotes      = '"' * lsb
	backslashes = '\\' * lsb
	spaces      = 0x20 * lsb
)

// special flags the bytes of x that are '"', '\\' or below 0x20.
func special(x uint64) uint64 {
	q, e := x^quotes, x^backslashes
	return ((q - lsb) &^ q) | ((e - lsb) &^ e) | below(x)
}

func below(x uint64) uint64 { return (x - spaces) &^ x & msb }

// indexSpecial returns the index of the first special byte in b[i:end], or
// end.
func indexSpecial(b []byte, i, end int) int {
	b = b[:end] // loops bounded by len(b) need no bounds checks
	for ; i+8 <= len(b); i += 8 {
		if m := special(binary.LittleEndian.Uint64(b[i:])) & msb; m != 0 {
			return i + bits.TrailingZeros64(m)>>3
		}
	}
	for ; i < len(b); i++ {
		if c := b[i]; c == '"' || c == '\\' || c < 0x20 {
			return i
		}
	}
	return len(b)
}

// indexControl returns the index of the first byte below 0x20 in b[i:end],
// or end. It tests 32 bytes per step while it can, then 8, then one.
func indexControl(b []byte, i, end int) int {
	b = b[:end]
	for ; i+32 <= len(b); i += 32 {
		w := b[i : i+32]
		if below(binary.LittleEndian.Uint64(w))|below(binary.LittleEndian.Uint64(w[8:]))|
			below(binary.LittleEndian.Uint64(w[16:]))|below(binary.LittleEndian.Uint64(w[24:])) != 0 {
			break
		}
	}
	for ; i+8 <= len(b); i += 8 {
		if m := below(binary.LittleEndian.Uint64(b[i:])); m != 0 {
			return i + bits.TrailingZeros64(m)>>3
		}
	}
	for ; i < len(b); i++ {
		if b[i] < 0x20 {
			return i
		}
	}
	return len(b)
}

func (s *scanner) skipWS() {
	for s.pos < len(s.buf) {
		switch s.buf[s.pos] {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return
		}
	}
}

// peek returns the byte at pos, or 0 at the end of the body (0 never starts a
// JSON token, so callers treat it as "unexpected").
func (s *scanner) peek() byte {
	if s.pos < len(s.buf) {
		return s.buf[s.pos]
	}
	return 0
}

// expect consumes c (after optional whitespace) or reports a syntax error.
func (s *scanner) expect(c byte, what string) error {
	s.skipWS()
	if s.peek() != c {
		return s.syntaxError(what)
	}
	s.pos++
	return nil
}

// syntaxError describes the byte at pos (or the end of the body) as
// unexpected; what, if not empty, says what would have been accepted.
func (s *scanner) syntaxError(what string) error {
	var msg string
	if s.pos >= len(s.buf) {
		msg = fmt.Sprintf("request body is not valid JSON: unexpected end at byte %d", s.pos)
	} else {
		msg = fmt.Sprintf("request body is not valid JSON: unexpected %s at byte %d", describe(s.buf[s.pos]), s.pos)
	}
	if what != "" {
		msg += ", expected " + what
	}
	return &Error{Message: msg}
}

func (s *scanner) errorf(format string, args ...any) error {
	return &Error{Message: "request body is not valid JSON: " + fmt.Sprintf(format, args...)}
}

// describe renders one byte of the body for an error message.
func describe(c byte) string {
	if c >= 0x20 && c < 0x7f {
		return fmt.Sprintf("%q", rune(c))
	}
	return fmt.Sprintf("byte 0x%02x", c)
}

// typeError reports that the value at pos has the wrong type. If that value
// is not valid JSON either, the syntax error is reported instead: it is the
// more useful of the two.
func (s *scanner) typeError(depth int, format string, args ...any) error {
	if err := s.skipValue(depth); err != nil {
		return err
	}
	return &Error{Message: fmt.Sprintf(format, args...)}
}

// inspectString reads the JSON string at pos, decoded into scratch space
// past the end of dst, lets inspect read it, then gives the space back: a
// value the caller only looks at (a type, a flag) stays out of Prompt.
func (s *scanner) inspectString(inspect func(decoded []byte)) error {
	mark := len(s.dst)
	err := s.appendString(false)
	inspect(s.dst[mark:])
	s.dst = s.dst[:mark]
	return err
}

// appendString decodes the JSON string at pos and appends its text to dst.
// With escapeNUL, a NUL character is written as "\x00\xff" so that the text
// cannot imitate the chat markers (which are NUL and a tag byte). Invalid
// UTF-8 is copied as it is; an unpaired surrogate escape becomes U+FFFD, as
// encoding/json decodes it.
func (s *scanner) appendString(escapeNUL bool) error {
	if s.peek() != '"' {
		return s.syntaxError("a string")
	}
	// Locals rather than fields: this loop is most of the time Parse takes.
	buf, dst, i := s.buf, s.dst, s.pos+1
	ends := newRunEnds()
	for {
		// ends.next, by hand: the call costs more than a short run.
		j := indexSpecial(buf, i, min(i+shortRun, len(buf)))
		if j == i+shortRun {
			j = ends.long(buf, j)
		}
		dst = append(dst, buf[i:j]...)
		if j < len(buf) && buf[j] == '"' {
			s.dst, s.pos = dst, j+1
			return nil
		}
		// The one-character escapes (\n, \", ...) stay on the fast path.
		if j+1 < len(buf) && buf[j] == '\\' {
			if c := simpleEscapes[buf[j+1]]; c != 0 {
				dst = append(dst, c)
				i = j + 2
				continue
			}
		}
		s.dst, s.pos = dst, j
		switch {
		case j >= len(buf):
			return s.syntaxError("'\"' to close the string")
		case buf[j] == '\\':
			if err := s.appendEscape(escapeNUL); err != nil {
				return err
			}
		default:
			return s.errorf("control character 0x%02x in string at byte %d", buf[j], j)
		}
		dst, i = s.dst, s.pos
	}
}

// simpleEscapes maps the byte after a backslash to the character it stands
// for, or to 0 for 'u' (handled apart) and invalid escapes. A lookup table,
// never written.
var simpleEscapes = [256]byte{
	'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t',
}

// appendEscape decodes the escape sequence at pos (which holds '\\') that
// appendString left to it: a \u escape, or an invalid one.
func (s *scanner) appendEscape(escapeNUL bool) error {
	if s.pos+1 >= len(s.buf) {
		s.pos = len(s.buf)
		return s.syntaxError("an escape sequence")
	}
	if s.buf[s.pos+1] != 'u' {
		return s.errorf("invalid escape %s at byte %d", describe(s.buf[s.pos+1]), s.pos)
	}
	r, err := s.hex4(s.pos + 2)
	if err != nil {
		return err
	}
	s.pos += 6
	if utf16.IsSurrogate(r) {
		// A valid pair is consumed whole; anything else leaves the next
		// escape to be decoded on its own, as encoding/json does.
		if s.pos+1 < len(s.buf) && s.buf[s.pos] == '\\' && s.buf[s.pos+1] == 'u' {
			if r2, err := s.hex4(s.pos + 2); err == nil {
				if d := utf16.DecodeRune(r, r2); d != utf8.RuneError {
					s.pos += 6
					s.dst = utf8.AppendRune(s.dst, d)
					return nil
				}
			}
		}
		r = utf8.RuneError
	}
	if r == 0 && escapeNUL {
		s.dst = append(s.dst, 0, 0xff)
	} else {
		s.dst = utf8.AppendRune(s.dst, r)
	}
	return nil
}

// hex4 reads the four hex digits of a \u escape starting at i.
func (s *scanner) hex4(i int) (rune, error) {
	if i+4 > len(s.buf) {
		return 0, s.errorf("unexpected end in \\u escape at byte %d", i-2)
	}
	var r rune
	for _, c := range s.buf[i : i+4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, s.errorf("invalid \\u escape at byte %d", i-2)
		}
		r = r<<4 | rune(c)
	}
	return r, nil
}

// skipString steps over the JSON string at pos, validating it.
func (s *scanner) skipString() error {
	s.pos++ // the opening quote, checked by the caller
	ends := newRunEnds()
	for {
		j := ends.next(s.buf, s.pos)
		s.pos = j
		if j >= len(s.buf) {
			return s.syntaxError("'\"' to close the string")
		}
		switch c := s.buf[j]; {
		case c == '"':
			s.pos++
			return nil
		case c == '\\':
			if j+1 >= len(s.buf) {
				s.pos = len(s.buf)
				return s.syntaxError("an escape sequence")
			}
			switch e := s.buf[j+1]; {
			case simpleEscapes[e] != 0:
				s.pos += 2
			case e == 'u':
				if _, err := s.hex4(j + 2); err != nil {
					return err
				}
				s.pos += 6
			default:
				return s.errorf("invalid escape %s at byte %d", describe(e), j)
			}
		default:
			return s.errorf("control character 0x%02x in string at byte %d", c, j)
		}
	}
}

// skipNumber steps over the JSON number at pos, validating its grammar:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) skipNumber() error {
	b, i := s.buf, s.pos
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = skipDigits(b, i+1)
	default:
		s.pos = i
		return s.syntaxError("a digit")
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.pos = i
			return s.syntaxError("a digit after '.'")
		}
		i = skipDigits(b, i)
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.pos = i
			return s.syntaxError("a digit in the exponent")
		}
		i = skipDigits(b, i)
	}
	s.pos = i
	return nil
}

func skipDigits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// literal consumes the keyword lit ("true", "false" or "null") at pos.
func (s *scanner) literal(lit string) error {
	end := s.pos + len(lit)
	if end <= len(s.buf) && string(s.buf[s.pos:end]) == lit {
		s.pos = end
		return nil
	}
	for i := 0; i < len(lit); i++ {
		if s.pos >= len(s.buf) || s.buf[s.pos] != lit[i] {
			return s.syntaxError(fmt.Sprintf("%q", lit))
		}
		s.pos++
	}
	return nil // unreachable: the fast path matched
}

// skipScalar steps over a string, number or literal at pos. It returns
// false, with no error, when pos holds '{' or '['.
func (s *scanner) skipScalar() (container bool, err error) {
	switch s.peek() {
	case '"':
		return false, s.skipString()
	case 't':
		return false, s.literal("true")
	case 'f':
		return false, s.literal("false")
	case 'n':
		return false, s.literal("null")
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		return false, s.skipNumber()
	case '{', '[':
		return true, nil
	}
	return false, s.syntaxError("a JSON value")
}

// skipValue validates and steps over one JSON value at pos (after optional
// whitespace). depth is the number of containers that enclose the value.
func (s *scanner) skipValue(depth int) error {
	s.skipWS()
	container, err := s.skipScalar()
	if !container {
		return err
	}
	return s.skipContainer(depth)
}

// skipContainer steps over the object or array at pos. Open containers are
// tracked in a bit stack instead of by recursion, so a deeply nested body
// costs neither stack growth nor allocations.
func (s *scanner) skipContainer(depth int) error {
	var stack [(maxDepth + 63) / 64]uint64 // bit set: the open container is an object
	n := 0                                 // containers open inside this value
	for {
		// pos holds '{' or '[': open it.
		if depth+n+1 > maxDepth {
			return s.errorf("nested deeper than %d levels at byte %d", maxDepth, s.pos)
		}
		object := s.buf[s.pos] == '{'
		s.pos++
		s.skipWS()
		if object && s.peek() == '}' || !object && s.peek() == ']' {
			s.pos++ // empty: a complete value
		} else {
			if object {
				stack[n>>6] |= 1 << (n & 63)
				if err := s.skipKey(); err != nil {
					return err
				}
			} else {
				stack[n>>6] &^= 1 << (n & 63)
			}
			n++
			open, err := s.skipElement()
			if err != nil {
				return err
			}
			if open {
				continue
			}
		}
		// A value has just ended: close containers until one goes on with
		// another container.
		for n > 0 {
			s.skipWS()
			object := stack[(n-1)>>6]&(1<<((n-1)&63)) != 0
			c := s.peek()
			if c == ',' {
				s.pos++
				if object {
					s.skipWS()
					if err := s.skipKey(); err != nil {
						return err
					}
				}
				open, err := s.skipElement()
				if err != nil {
					return err
				}
				if open {
					break
				}
				continue
			}
			if object && c == '}' || !object && c == ']' {
				s.pos++
				n--
				continue
			}
			if object {
				return s.syntaxError("',' or '}'")
			}
			return s.syntaxError("',' or ']'")
		}
		if n == 0 {
			return nil
		}
	}
}

// skipElement steps over a scalar after optional whitespace, or reports that
// a container opens at pos.
func (s *scanner) skipElement() (open bool, err error) {
	s.skipWS()
	return s.skipScalar()
}

// skipKey steps over an object key and the colon after it.
func (s *scanner) skipKey() error {
	if s.peek() != '"' {
		return s.syntaxError("a string key")
	}
	if err := s.skipString(); err != nil {
		return err
	}
	return s.expect(':', "':'")
}

// appendRaw validates the value at pos and appends its JSON text, unchanged,
// to dst.
func (s *scanner) appendRaw(depth int) error {
	start := s.pos
	if err := s.skipValue(depth); err != nil {
		return err
	}
	s.dst = append(s.dst, s.buf[start:s.pos]...)
	return nil
}

// key reads the object key at pos (and the colon after it) and returns which
// known field it names. Keys without escapes are compared in place; the rare
// escaped key is decoded into scratch space past the end of dst.
func (s *scanner) key() (field, error) {
	if s.peek() != '"' {
		return fieldUnknown, s.syntaxError("a string key")
	}
	start := s.pos + 1
	var f field
	ends := newRunEnds()
	if j := ends.next(s.buf, start); j < len(s.buf) && s.buf[j] == '"' {
		f = fieldOf(s.buf[start:j])
		s.pos = j + 1
	} else {
		mark := len(s.dst)
		err := s.appendString(false)
		f = fieldOf(s.dst[mark:])
		s.dst = s.dst[:mark]
		if err != nil {
			return fieldUnknown, err
		}
	}
	if err := s.expect(':', "':'"); err != nil {
		return fieldUnknown, err
	}
	s.skipWS()
	return f, nil
}

// next consumes what follows a member of an object or an element of an array:
// ',' (more follows) or the closing bracket (done).
func (s *scanner) next(closer byte) (more bool, err error) {
	s.skipWS()
	switch s.peek() {
	case ',':
		s.pos++
		s.skipWS()
		return true, nil
	case closer:
		s.pos++
		return false, nil
	}
	return false, s.syntaxError(fmt.Sprintf("',' or '%c'", closer))
}

// open consumes the opening bracket at pos and reports whether the container
// is empty (its closing bracket is consumed too).
func (s *scanner) open(closer byte) (empty bool) {
	s.pos++
	s.skipWS()
	if s.peek() == closer {
		s.pos++
		return true
	}
	return false
}

// elements reads the array at pos (the caller has seen its '['): element
// reads the i-th element, at pos.
func (s *scanner) elements(element func(i int) error) error {
	if s.open(']') {
		return nil
	}
	for i, more := 0, true; more; i++ {
		if err := element(i); err != nil {
			return err
		}
		var err error
		if more, err = s.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// members reads the object at pos (the caller has seen its '{'): member
// reads the value, at pos, of a key that names f (fieldUnknown for a key
// Parse does not read).
func (s *scanner) members(member func(f field) error) error {
	if s.open('}') {
		return nil
	}
	for more := true; more; {
		f, err := s.key()
		if err != nil {
			return err
		}
		if err = member(f); err != nil {
			return err
		}
		if more, err = s.next('}'); err != nil {
			return err
		}
	}
	return nil
}

// unsigned reads a JSON number at pos that must be an integer from 0 to limit.
// ok is false (with no error) for a valid number that is not such an integer.
func (s *scanner) unsigned(limit uint64) (v uint64, ok bool, err error) {
	b, start := s.buf, s.pos
	i := start
	ok = true
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		if v > (limit-uint64(b[i]-'0'))/10 {
			ok = false // keep going: the number must still be validated
		} else {
			v = v*10 + uint64(b[i]-'0')
		}
		i++
	}
	switch {
	case i == start: // '-' or not a number
		ok = false
	case i-start > 1 && b[start] == '0':
		return 0, false, s.errorf("number with a leading zero at byte %d", start)
	case i < len(b) && (b[i] == '.' || b[i] == 'e' || b[i] == 'E'):
		ok = false
	default:
		s.pos = i
		return v, ok, nil
	}
	// Not a plain integer: validate it as a number so that bad JSON is
	// reported as such, and let the caller name the field.
	if err := s.skipNumber(); err != nil {
		return 0, false, err
	}
	return 0, false, nil
}

// integer reads a JSON number at pos whose value is an integer from 0 to
// limit, however it is written: 100, but also 100.0, 1e2 or -0, which vLLM's
// request models (pydantic, in its default lax mode) accept for integer
// fields; 100.5 is not an integer. ok is false, with no error, for a valid
// number that is not such an integer. Numbers not written as plain integers
// take the slower path through strconv.ParseFloat, as Python reads them.
func (s *scanner) integer(limit uint64) (v uint64, ok bool, err error) {
	start := s.pos
	if v, ok, err = s.unsigned(limit); ok || err != nil {
		return v, ok, err
	}
	f, perr := strconv.ParseFloat(string(s.buf[start:s.pos]), 64)
	if perr != nil || f < 0 || f > float64(limit) || f != math.Trunc(f) {
		return 0, false, nil
	}
	return uint64(f), true, nil
}
