package storage

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// A btrfs send stream from a registry is untrusted input to `btrfs receive`, which runs
// as root. --chroot keeps its paths inside the target directory, but two commands name
// other subvolumes of the file system by UUID: SNAPSHOT (the parent an incremental
// stream applies to) and CLONE (copy a byte range from a file of any subvolume). A
// crafted stream could thus copy another sandbox's files into the one being received.
// sendFilter sits between the stream and receive and passes only streams that name no
// subvolume but the expected parent and the received subvolume itself, holding exactly
// one subvolume and nothing after its END command.
//
// The format (fs/btrfs/send.h): a header "btrfs-stream\0" + le32 version, then commands
// of a 10-byte header (le32 length of the body, le16 command, le32 crc) and a body of
// TLV attributes (le16 type, le16 length, value). Only the three commands above are
// parsed; every other command is passed through by its length unread. Version 2 and 3
// streams differ only in commands passed through unread.

const (
	sendMagic     = "btrfs-stream\x00"
	sendHeaderLen = len(sendMagic) + 4
	sendCmdLen    = 10

	sendCmdSubvol   = 1
	sendCmdSnapshot = 2
	sendCmdClone    = 16
	sendCmdEnd      = 21

	sendAttrUUID      = 1
	sendAttrCloneUUID = 20

	// maxSendVersion is the newest stream version the filter accepts.
	maxSendVersion = 3
	// maxParsedCmd bounds the commands the filter reads whole (SUBVOL, SNAPSHOT, CLONE:
	// a few paths and numbers; the kernel never makes them larger than 64 KiB).
	maxParsedCmd = 64 << 10
)

// uuid is a btrfs subvolume UUID.
type uuid [16]byte

func (u uuid) isZero() bool { return u == uuid{} }

func (u uuid) String() string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// ErrBadStream marks a send stream that was refused: malformed, or naming subvolumes it
// may not (see sendFilter).
var ErrBadStream = errors.New("refused btrfs send stream")

// sendFilter is an io.Reader that validates a send stream while passing it through.
type sendFilter struct {
	r       *bufio.Reader
	parents []uuid // allowed parents of an incremental stream; none: must be a full stream

	started bool // header read
	sub     bool // SUBVOL or SNAPSHOT seen
	ended   bool // END seen
	self    uuid // the received subvolume's UUID (from SUBVOL/SNAPSHOT)

	pending []byte // validated bytes not yet returned
	pass    int64  // body bytes of the current command still to pass through unread
	err     error  // sticky
	n       int64  // bytes passed
}

func newSendFilter(r io.Reader, parents []uuid) *sendFilter {
	return &sendFilter{r: bufio.NewReaderSize(r, 256<<10), parents: parents}
}

func (f *sendFilter) Read(p []byte) (int, error) {
	for len(f.pending) == 0 && f.pass == 0 {
		if f.err != nil {
			return 0, f.err
		}
		if err := f.next(); err != nil {
			f.err = err
			return 0, err
		}
	}
	if len(f.pending) > 0 {
		n := copy(p, f.pending)
		f.pending = f.pending[n:]
		f.n += int64(n)
		return n, nil
	}
	if int64(len(p)) > f.pass {
		p = p[:f.pass]
	}
	n, err := f.r.Read(p)
	f.pass -= int64(n)
	f.n += int64(n)
	if errors.Is(err, io.EOF) {
		if f.pass > 0 {
			err = fmt.Errorf("%w: stream ends inside a command", ErrBadStream)
			f.err = err
			return n, err
		}
		err = nil
	}
	if err != nil {
		f.err = err
	}
	return n, err
}

// bad records and returns a refusal.
func (f *sendFilter) bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadStream, fmt.Sprintf(format, args...))
}

// next reads the next header or command into f.pending (and f.pass).
func (f *sendFilter) next() error {
	if !f.started {
		hdr := make([]byte, sendHeaderLen)
		if _, err := io.ReadFull(f.r, hdr); err != nil {
			return f.bad("no stream header (%v)", err)
		}
		if string(hdr[:len(sendMagic)]) != sendMagic {
			return f.bad("not a btrfs send stream")
		}
		if v := binary.LittleEndian.Uint32(hdr[len(sendMagic):]); v < 1 || v > maxSendVersion {
			return f.bad("unsupported stream version %d", v)
		}
		f.started = true
		f.pending = hdr
		return nil
	}
	if f.ended {
		if _, err := f.r.ReadByte(); errors.Is(err, io.EOF) {
			return io.EOF
		} else if err != nil {
			return err
		}
		return f.bad("data after the end of the stream")
	}
	hdr := make([]byte, sendCmdLen)
	if _, err := io.ReadFull(f.r, hdr); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return f.bad("stream ends before its end command")
		}
		return err
	}
	size := binary.LittleEndian.Uint32(hdr[0:4])
	cmd := binary.LittleEndian.Uint16(hdr[4:6])
	if !f.sub && cmd != sendCmdSubvol && cmd != sendCmdSnapshot {
		return f.bad("stream does not start with a subvolume (command %d)", cmd)
	}
	switch cmd {
	case sendCmdSubvol, sendCmdSnapshot, sendCmdClone:
		if size > maxParsedCmd {
			return f.bad("command %d of %d bytes", cmd, size)
		}
		body := make([]byte, size)
		if _, err := io.ReadFull(f.r, body); err != nil {
			return f.bad("stream ends inside a command (%v)", err)
		}
		attrs, err := parseTLVs(body)
		if err != nil {
			return f.bad("command %d: %v", cmd, err)
		}
		if err := f.check(cmd, attrs); err != nil {
			return err
		}
		f.pending = append(hdr, body...)
		return nil
	case sendCmdEnd:
		f.ended = true
	}
	f.pending = hdr
	f.pass = int64(size)
	return nil
}

// check validates one parsed command.
func (f *sendFilter) check(cmd uint16, attrs map[uint16][]byte) error {
	switch cmd {
	case sendCmdSubvol, sendCmdSnapshot:
		if f.sub {
			return f.bad("more than one subvolume in the stream")
		}
		f.sub = true
		id, ok := attrUUID(attrs, sendAttrUUID)
		if !ok {
			return f.bad("subvolume without a UUID")
		}
		f.self = id
		if cmd == sendCmdSubvol {
			if len(f.parents) > 0 {
				return f.bad("a full stream where an increment on %s was expected", f.parents[0])
			}
			return nil
		}
		parent, ok := attrUUID(attrs, sendAttrCloneUUID)
		if !ok {
			return f.bad("snapshot without a parent UUID")
		}
		if len(f.parents) == 0 {
			return f.bad("an increment on %s where a full stream was expected", parent)
		}
		if !f.allowed(parent) {
			return f.bad("an increment on %s, not on the expected parent %s", parent, f.parents[0])
		}
	case sendCmdClone:
		src, ok := attrUUID(attrs, sendAttrCloneUUID)
		if !ok {
			return f.bad("clone without a source UUID")
		}
		if src != f.self && !f.allowed(src) {
			return f.bad("clone from subvolume %s, which is neither the stream's nor its parent", src)
		}
	}
	return nil
}

func (f *sendFilter) allowed(id uuid) bool {
	for _, p := range f.parents {
		if !p.isZero() && p == id {
			return true
		}
	}
	return false
}

// parseTLVs splits a command body into its attributes (the last of a repeated type wins).
func parseTLVs(b []byte) (map[uint16][]byte, error) {
	attrs := map[uint16][]byte{}
	for len(b) > 0 {
		if len(b) < 4 {
			return nil, errors.New("truncated attribute")
		}
		typ := binary.LittleEndian.Uint16(b[0:2])
		n := int(binary.LittleEndian.Uint16(b[2:4]))
		if len(b) < 4+n {
			return nil, errors.New("attribute longer than its command")
		}
		attrs[typ] = b[4 : 4+n]
		b = b[4+n:]
	}
	return attrs, nil
}

func attrUUID(attrs map[uint16][]byte, typ uint16) (uuid, bool) {
	v, ok := attrs[typ]
	if !ok || len(v) != 16 {
		return uuid{}, false
	}
	var u uuid
	copy(u[:], v)
	return u, !u.isZero()
}

// isNoSpace reports whether a tool's output says the file system is full.
func isNoSpace(out []byte) bool {
	return bytes.Contains(out, []byte("No space left on device")) || bytes.Contains(out, []byte("Disk quota exceeded"))
}
