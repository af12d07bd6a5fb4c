package request

import (
	"fmt"
	"math"
)

// Markers: NUL and a tag byte (see the package documentation).
const (
	markTools      = "\x00T"
	markRole       = "\x00R"
	markContent    = "\x00C"
	markPart       = "\x00P"
	markToolCalls  = "\x00F"
	markToolCallID = "\x00I"
	markName       = "\x00N"
	markEnd        = "\x00E"
	markPrevious   = "\x00Q"
	markItem       = "\x00X"
	// instructions and a string input read as the messages a server renders
	// them as, so that they share prefix bytes with the same conversation
	// sent to /v1/chat/completions.
	markSystem = markRole + "system" + markContent
	markUser   = markRole + "user" + markContent
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

const promptShapes = "%q must be a string, an array of strings, an array of token ids or an array of token-id arrays"

// prompt reads the "prompt" of a completions request, or the "input" of an
// embeddings request (f names which).
func (s *scanner) prompt(f field) error {
	switch s.peek() {
	case '"':
		return s.appendString(false)
	case '[':
	default:
		return s.typeError(depthTop, promptShapes, f)
	}
	// The first element fixes the shape of all of them.
	var first byte
	return s.elements(func(i int) error {
		c := s.peek()
		if i == 0 {
			first = c
		}
		switch {
		case first == '"' && c == '"':
			if i > 0 {
				s.dst = append(s.dst, '\n')
			}
			return s.appendString(false)
		case first == '[' && c == '[':
			return s.tokenIDs(depthMessage, f)
		case (first == '-' || first >= '0' && first <= '9') && (c == '-' || c >= '0' && c <= '9'):
			return s.tokenID(f)
		}
		return s.typeError(depthMessage, promptShapes, f)
	})
}

// tokenIDs reads an array of token ids at the given depth.
func (s *scanner) tokenIDs(depth int, f field) error {
	return s.elements(func(int) error {
		if c := s.peek(); c != '-' && (c < '0' || c > '9') {
			return s.typeError(depth+1, promptShapes, f)
		}
		return s.tokenID(f)
	})
}

// tokenID appends one token id (a number at pos) as 4 bytes, little-endian.
func (s *scanner) tokenID(f field) error {
	v, ok, err := s.integer(math.MaxUint32)
	if err != nil {
		return err
	}
	if !ok {
		return &Error{Message: fmt.Sprintf(`%q token ids must be integers from 0 to %d`, f, uint32(math.MaxUint32))}
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
	return s.elements(s.message)
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
	err := s.members(func(f field) error {
		seen.add(f)
		switch f {
		case fieldRole:
			return s.role(i, false, &order)
		case fieldContent:
			return s.messageContent(i, false, &order)
		case fieldToolCalls:
			return s.toolCalls(i, &order)
		case fieldToolCallID:
			return s.optionalString(i, f, markToolCallID, &order, rankToolCallID)
		case fieldName:
			return s.optionalString(i, f, markName, &order, rankName)
		}
		return s.skipValue(depthField)
	})
	if err != nil {
		return err
	}
	if !seen.has(fieldRole) {
		return &Error{Message: fmt.Sprintf("\"messages[%d]\" has no \"role\" field", i)}
	}
	s.dst = append(s.dst, markEnd...)
	return nil
}

// role reads the "role" of message i (of "messages", or of a Responses
// "input"). It, messageContent, toolCalls and optionalString each take out
// what an earlier key of the same name wrote (the last one wins) and put
// what they read at its rank in order.
func (s *scanner) role(i int, responses bool, order *segments) error {
	if s.peek() != '"' {
		return s.typeError(depthField, "\"%s[%d].role\" must be a string", listName(responses), i)
	}
	s.dst = order.remove(s.dst, rankRole)
	start := len(s.dst)
	s.dst = append(s.dst, markRole...)
	if err := s.appendString(true); err != nil {
		return err
	}
	s.dst = order.place(s.dst, rankRole, start)
	return nil
}

// messageContent reads the "content" of message i (see content).
func (s *scanner) messageContent(i int, responses bool, order *segments) error {
	s.dst = order.remove(s.dst, rankContent)
	start := len(s.dst)
	if err := s.content(i, responses); err != nil {
		return err
	}
	if len(s.dst) > start {
		s.dst = order.place(s.dst, rankContent, start)
	}
	return nil
}

// toolCalls reads the "tool_calls" of messages[i]: an array, kept as its raw
// JSON text, or null.
func (s *scanner) toolCalls(i int, order *segments) error {
	s.dst = order.remove(s.dst, rankToolCalls)
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '[':
		start := len(s.dst)
		s.dst = append(s.dst, markToolCalls...)
		if err := s.appendRaw(depthField); err != nil {
			return err
		}
		s.dst = order.place(s.dst, rankToolCalls, start)
		return nil
	}
	return s.typeError(depthField, "\"messages[%d].tool_calls\" must be an array or null", i)
}

// optionalString reads a message field that is a string or null.
func (s *scanner) optionalString(i int, f field, mark string, order *segments, rank int) error {
	s.dst = order.remove(s.dst, rank)
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

// listName names the array a message belongs to, for error messages.
func listName(responses bool) string {
	if responses {
		return "input"
	}
	return "messages"
}

// content reads the content of message i (of "messages", or of a Responses
// "input"): a string, an array of parts, or null (which contributes
// nothing).
func (s *scanner) content(i int, responses bool) error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		s.dst = append(s.dst, markContent...)
		return s.appendString(true)
	case '[':
	default:
		return s.typeError(depthField, "\"%s[%d].content\" must be a string, an array of parts or null", listName(responses), i)
	}
	s.dst = append(s.dst, markContent...)
	return s.elements(func(j int) error { return s.part(i, j, responses) })
}

// isTextPart reports whether a content part's type says it holds text:
// "text" in chat, "input_text" or "output_text" in the Responses API.
func isTextPart(typ []byte, responses bool) bool {
	if responses {
		return string(typ) == "input_text" || string(typ) == "output_text"
	}
	return string(typ) == "text"
}

// part reads content[j] of message i. A text part contributes its text; any
// other part contributes its raw JSON, which holds its URL or data. Because
// "type" may follow "text" in the body, the text is decoded on sight and
// dropped again if the part turns out not to be text.
func (s *scanner) part(i, j int, responses bool) error {
	if s.peek() != '{' {
		return s.typeError(depthPart, "\"%s[%d].content[%d]\" must be an object", listName(responses), i, j)
	}
	start, mark := s.pos, len(s.dst)
	var (
		isText bool
		textOK bool // the last "text" was a string (and is in dst[mark:])
	)
	err := s.members(func(f field) error {
		switch {
		case f == fieldType && s.peek() == '"':
			return s.inspectString(func(typ []byte) { isText = isTextPart(typ, responses) })
		case f == fieldType:
			isText = false
		case f == fieldText && s.peek() == '"':
			s.dst = s.dst[:mark] // the last one wins
			err := s.appendString(true)
			textOK = err == nil
			return err
		case f == fieldText:
			s.dst, textOK = s.dst[:mark], false
		}
		return s.skipValue(depthInPart)
	})
	if err != nil {
		return err
	}
	if isText {
		if !textOK {
			return &Error{Message: fmt.Sprintf("\"%s[%d].content[%d]\" has a text type but no \"text\" string", listName(responses), i, j)}
		}
		return nil
	}
	s.dst = append(s.dst[:mark], markPart...)
	s.dst = append(s.dst, s.buf[start:s.pos]...)
	return nil
}

// previousResponse reads the "previous_response_id" of a Responses request:
// a string or null.
func (s *scanner) previousResponse() error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		s.dst = append(s.dst, markPrevious...)
		return s.appendString(true)
	}
	return s.typeError(depthTop, `"previous_response_id" must be a string or null`)
}

// instructions reads the "instructions" of a Responses request: a string
// (read as a system message) or null.
func (s *scanner) instructions() error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		return s.stringMessage(markSystem)
	}
	return s.typeError(depthTop, `"instructions" must be a string or null`)
}

// stringMessage reads the string at pos as the text of a whole message:
// head holds its role and content markers.
func (s *scanner) stringMessage(head string) error {
	s.dst = append(s.dst, head...)
	if err := s.appendString(true); err != nil {
		return err
	}
	s.dst = append(s.dst, markEnd...)
	return nil
}

// responsesInput reads the "input" of a Responses request: a string (read as
// a user message), an array of items, or null.
func (s *scanner) responsesInput() error {
	switch s.peek() {
	case 'n':
		return s.literal("null")
	case '"':
		return s.stringMessage(markUser)
	case '[':
	default:
		return s.typeError(depthTop, `"input" must be a string, an array of items or null`)
	}
	return s.elements(s.item)
}

// item reads input[i] of a Responses request. An item with a "role" whose
// "type" is absent or "message" is a message, written as chat messages are
// (role, then content); any other item (a function call, its output, a
// reasoning item, a reference to an earlier item by its "id" alone, ...)
// contributes its raw JSON. As in part, the type may come last, so the
// message is written on sight and replaced by the raw JSON at the end if
// the item is not one.
func (s *scanner) item(i int) error {
	if s.peek() != '{' {
		return s.typeError(depthMessage, "\"input[%d]\" must be an object", i)
	}
	start, mark := s.pos, len(s.dst)
	var (
		seen    fieldSet
		order   segments
		message = true
	)
	err := s.members(func(f field) error {
		seen.add(f)
		switch f {
		case fieldType:
			if s.peek() != '"' {
				return s.typeError(depthField, "\"input[%d].type\" must be a string", i)
			}
			return s.inspectString(func(typ []byte) { message = string(typ) == "message" })
		case fieldRole:
			return s.role(i, true, &order)
		case fieldContent:
			return s.messageContent(i, true, &order)
		}
		return s.skipValue(depthField)
	})
	if err != nil {
		return err
	}
	if !message || !seen.has(fieldRole) {
		s.dst = append(s.dst[:mark], markItem...)
		s.dst = append(s.dst, s.buf[start:s.pos]...)
		return nil
	}
	s.dst = append(s.dst, markEnd...)
	return nil
}
