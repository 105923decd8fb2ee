package streamrec.flink;

/** The counter windows, passed to the functions as a literal like "60000,600000". */
final class Windows {
    private Windows() {}

    static long[] parse(String text) {
        String[] parts = text.split(",");
        long[] out = new long[parts.length];
        for (int i = 0; i < parts.length; i++) {
            out[i] = Long.parseLong(parts[i].trim());
        }
        return out;
    }

    static long max(long[] windows) {
        long m = 0;
        for (long w : windows) m = Math.max(m, w);
        return m;
    }
}
