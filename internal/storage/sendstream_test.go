package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
)

// Synthetic send streams: a header and commands with just the attributes the filter
// reads (crc left zero: btrfs receive checks it, the filter does not).

func streamHeader(version uint32) []byte {
	b := []byte(sendMagic)
	return binary.LittleEndian.AppendUint32(b, version)
}

func tlv(typ uint16, v []byte) []byte {
	b := binary.LittleEndian.AppendUint16(nil, typ)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

func command(cmd uint16, attrs ...[]byte) []byte {
	body := bytes.Join(attrs, nil)
	b := binary.LittleEndian.AppendUint32(nil, uint32(len(body)))
	b = binary.LittleEndian.AppendUint16(b, cmd)
	b = binary.LittleEndian.AppendUint32(b, 0)
	return append(b, body...)
}

func id(n byte) uuid { return uuid{n, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} }

const (
	cmdMkfile = 3
	cmdWrite  = 15
	attrPath  = 15
	attrData  = 19
)

func TestSendFilter(t *testing.T) {
	self, parent, other := id(1), id(2), id(3)
	snapshot := command(sendCmdSnapshot, tlv(attrPath, []byte("rootfs")), tlv(sendAttrUUID, self[:]), tlv(sendAttrCloneUUID, parent[:]))
	subvol := command(sendCmdSubvol, tlv(attrPath, []byte("rootfs")), tlv(sendAttrUUID, self[:]))
	write := command(cmdWrite, tlv(attrPath, []byte("f")), tlv(attrData, bytes.Repeat([]byte("x"), 3000)))
	mkfile := command(cmdMkfile, tlv(attrPath, []byte("f")))
	clone := func(src uuid) []byte {
		return command(sendCmdClone, tlv(attrPath, []byte("g")), tlv(sendAttrCloneUUID, src[:]))
	}
	end := command(sendCmdEnd)
	join := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

	for _, tc := range []struct {
		name    string
		stream  []byte
		parents []uuid
		ok      bool
	}{
		{"full", join(streamHeader(1), subvol, mkfile, write, clone(self), end), nil, true},
		{"increment", join(streamHeader(1), snapshot, mkfile, write, clone(parent), clone(self), end), []uuid{parent}, true},
		{"increment on a received parent", join(streamHeader(2), snapshot, end), []uuid{id(9), parent}, true},
		{"clone from another subvolume", join(streamHeader(1), snapshot, mkfile, clone(other), end), []uuid{parent}, false},
		{"clone from another subvolume in a full stream", join(streamHeader(1), subvol, mkfile, clone(parent), end), nil, false},
		{"increment on another parent", join(streamHeader(1), snapshot, end), []uuid{other}, false},
		{"increment where a full stream is expected", join(streamHeader(1), snapshot, end), nil, false},
		{"full where an increment is expected", join(streamHeader(1), subvol, end), []uuid{parent}, false},
		{"two subvolumes", join(streamHeader(1), subvol, end, subvol, end), nil, false},
		{"second stream after the end", join(streamHeader(1), subvol, end, streamHeader(1), subvol, end), nil, false},
		{"no end", join(streamHeader(1), subvol, mkfile), nil, false},
		{"command before the subvolume", join(streamHeader(1), mkfile, subvol, end), nil, false},
		{"truncated command", join(streamHeader(1), subvol, write[:100]), nil, false},
		{"not a stream", []byte("hello, this is not a btrfs stream at all"), nil, false},
		{"version 4", join(streamHeader(4), subvol, end), nil, false},
		{"empty", nil, nil, false},
	} {
		out, err := io.ReadAll(newSendFilter(bytes.NewReader(tc.stream), tc.parents))
		if tc.ok {
			if err != nil || !bytes.Equal(out, tc.stream) {
				t.Errorf("%s: %v (passed %d of %d bytes)", tc.name, err, len(out), len(tc.stream))
			}
			continue
		}
		if !errors.Is(err, ErrBadStream) {
			t.Errorf("%s: error %v, want ErrBadStream", tc.name, err)
		}
	}

	// The refused command itself is never passed on.
	stream := join(streamHeader(1), snapshot, mkfile, clone(other), end)
	out, _ := io.ReadAll(newSendFilter(bytes.NewReader(stream), []uuid{parent}))
	if want := len(streamHeader(1)) + len(snapshot) + len(mkfile); len(out) != want {
		t.Errorf("passed %d bytes of a stream refused at byte %d", len(out), want)
	}

	// A source error passes through as it is.
	boom := errors.New("boom")
	_, err := io.ReadAll(newSendFilter(io.MultiReader(bytes.NewReader(join(streamHeader(1), subvol, write[:50])), errReader{boom}), nil))
	if !errors.Is(err, boom) {
		t.Errorf("source error: %v", err)
	}
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }
