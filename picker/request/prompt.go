package request

import (
	"fmt"
	"math"
)

// Chat markers: NUL and a tag byte (see the package documentation).
const (
	markTools      = "\x00T"
	markRole       = "\x00R"
	markContent    = "\x00C"
	markPart       = "\x00P"
	markToolCalls  = "\x00F"
	markToolCallID = "\x00I"
	markName       = "\x00N"
	markEnd        = "\x00E"
)

// Ranks of the fields of a message: the order they take in Prompt.
const (
	rankRole = iota
	rankContent
	rankToolCalls
	rankToolCallID
	rankName
)

// Nesting depths (containers that enclose the value) of the values read below.
const (
	depthTop     = 1 // a member of the top-level object
	depthMessage = 2 // an element of "messages", or of "prompt"
	depthField   = 3 // a member of a message
	depthPart    = 4 // an element of "content"
	depthInPart  = 5 // a member of a content part
)

const promptShapes = `"prompt" must be a string, an array of strings, an array of token ids or an array of token-id arrays`

// prompt reads the "prompt" of a completions request.
func (s *scanner) prompt() error {
	switch s.peek() {
	case '"':
		return s.appendString(false)
	case '[':
	default:
		return s.typeError(depthTop, promptShapes)
	}
	if s.open(']') {
		return nil
	}
	// The first element fixes the shape of all of them.
	first := s.peek()
	for i, more := 0, true; more; i++ {
		var err error
		switch c := s.peek(); {
		case first == '"' && c == '"':
			if i > 0 {
				s.dst = append(s.dst, '\n')
			}
			err = s.appendString(false)
		case first == '[' && c == '[':
			err = s.tokenIDs(depthMessage)
		case (first == '-' || first >= '0' && first <= '9') && (c == '-' || c >= '0' && c <= '9'):
			err = s.tokenID()
		default:
			err = s.typeError(depthMessage, promptShapes)
		}
		if err != nil {
			return err
		}
		if more, err = s.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// tokenIDs reads an array of token ids at the given depth.
func (s *scanner) tokenIDs(depth int) error {
	if s.open(']') {
		return nil
	}
	for more := true; more; {
		c := s.peek()
		if c != '-' && (c < '0' || c > '9') {
			return s.typeError(depth+1, promptShapes)
		}
		err := s.tokenID()
		if err != nil {
			return err
		}
		if more, err = s.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// tokenID appends one token id (a number at pos) as 4 bytes, little-endian.
func (s *scanner) tokenID() error {
	v, ok, err := s.unsigned(math.MaxUint32)
	if err != nil {
		return err
	}
	if !ok {
		return &Error{Message: fmt.Sprintf(`"prompt" token ids must be integers from 0 to %d`, uint32(math.MaxUint32))}
	}
	s.dst = append(s.dst, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
	return nil
}

// tools reads "tools": an array, kept as its raw JSON text, or null.
func (s *scanner) tools() error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '[':
		s.dst = append(s.dst, markTools...)
		return s.appendRaw(depthTop)
	}
	return s.typeError(depthTop, `"tools" must be an array or null`)
}

// messages reads the "messages" array of a chat request.
func (s *scanner) messages() error {
	if s.peek() != '[' {
		return s.typeError(depthTop, `"messages" must be an array`)
	}
	if s.open(']') {
		return nil
	}
	for i, more := 0, true; more; i++ {
		if err := s.message(i); err != nil {
			return err
		}
		var err error
		if more, err = s.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// message reads messages[i].
func (s *scanner) message(i int) error {
	if s.peek() != '{' {
		return s.typeError(depthMessage, "\"messages[%d]\" must be an object", i)
	}
	var (
		seen  fieldSet
		order segments
	)
	if !s.open('}') {
		for more := true; more; {
			f, err := s.key()
			if err != nil {
				return err
			}
			switch f {
			case fieldRole, fieldContent, fieldToolCalls, fieldToolCallID, fieldName:
				if seen.add(f) {
					return &Error{Message: fmt.Sprintf("\"messages[%d]\" has more than one %q field", i, f)}
				}
			}
			start := len(s.dst)
			switch f {
			case fieldRole:
				if s.peek() != '"' {
					return s.typeError(depthField, "\"messages[%d].role\" must be a string", i)
				}
				s.dst = append(s.dst, markRole...)
				if err = s.appendString(true); err == nil {
					s.dst = order.place(s.dst, rankRole, start)
				}
			case fieldContent:
				if err = s.content(i); err == nil && len(s.dst) > start {
					s.dst = order.place(s.dst, rankContent, start)
				}
			case fieldToolCalls:
				switch s.peek() {
				case 'n':
					err = s.literal("null")
				case '[':
					s.dst = append(s.dst, markToolCalls...)
					if err = s.appendRaw(depthField); err == nil {
						s.dst = order.place(s.dst, rankToolCalls, start)
					}
				default:
					return s.typeError(depthField, "\"messages[%d].tool_calls\" must be an array or null", i)
				}
			case fieldToolCallID:
				err = s.optionalString(i, f, markToolCallID, &order, rankToolCallID)
			case fieldName:
				err = s.optionalString(i, f, markName, &order, rankName)
			default:
				err = s.skipValue(depthField)
			}
			if err != nil {
				return err
			}
			if more, err = s.next('}'); err != nil {
				return err
			}
		}
	}
	if !seen.has(fieldRole) {
		return &Error{Message: fmt.Sprintf("\"messages[%d]\" has no \"role\" field", i)}
	}
	s.dst = append(s.dst, markEnd...)
	return nil
}

// optionalString reads a message field that is a string or null.
func (s *scanner) optionalString(i int, f field, mark string, order *segments, rank int) error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		start := len(s.dst)
		s.dst = append(s.dst, mark...)
		if err := s.appendString(true); err != nil {
			return err
		}
		s.dst = order.place(s.dst, rank, start)
		return nil
	}
	return s.typeError(depthField, "\"messages[%d].%s\" must be a string or null", i, f)
}

// content reads messages[i].content: a string, an array of parts, or null
// (which contributes nothing).
func (s *scanner) content(i int) error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		s.dst = append(s.dst, markContent...)
		return s.appendString(true)
	case '[':
	default:
		return s.typeError(depthField, "\"messages[%d].content\" must be a string, an array of parts or null", i)
	}
	s.dst = append(s.dst, markContent...)
	if s.open(']') {
		return nil
	}
	for j, more := 0, true; more; j++ {
		if err := s.part(i, j); err != nil {
			return err
		}
		var err error
		if more, err = s.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// part reads messages[i].content[j]. A part of type "text" contributes its
// text; any other part contributes its raw JSON, which holds its URL or data.
// Because "type" may follow "text" in the body, the text is decoded on sight
// and dropped again if the part turns out not to be text.
func (s *scanner) part(i, j int) error {
	if s.peek() != '{' {
		return s.typeError(depthPart, "\"messages[%d].content[%d]\" must be an object", i, j)
	}
	start, mark := s.pos, len(s.dst)
	var (
		seen      fieldSet
		isText    bool
		textOK    bool // "text" was a string (and is in dst[mark:])
		typeKnown bool
	)
	if !s.open('}') {
		for more := true; more; {
			f, err := s.key()
			if err != nil {
				return err
			}
			switch f {
			case fieldType, fieldText:
				if seen.add(f) {
					return &Error{Message: fmt.Sprintf("\"messages[%d].content[%d]\" has more than one %q field", i, j, f)}
				}
			}
			switch {
			case f == fieldType && s.peek() == '"':
				at := len(s.dst)
				err = s.appendString(false)
				isText = string(s.dst[at:]) == "text"
				typeKnown = true
				s.dst = s.dst[:at]
			case f == fieldText && s.peek() == '"' && (!typeKnown || isText):
				err = s.appendString(true)
				textOK = err == nil
			default:
				err = s.skipValue(depthInPart)
			}
			if err != nil {
				return err
			}
			if more, err = s.next('}'); err != nil {
				return err
			}
		}
	}
	if isText {
		if !textOK {
			return &Error{Message: fmt.Sprintf("\"messages[%d].content[%d]\" has type \"text\" but no \"text\" string", i, j)}
		}
		return nil
	}
	s.dst = append(s.dst[:mark], markPart...)
	s.dst = append(s.dst, s.buf[start:s.pos]...)
	return nil
}
